"""Archives are unpacked by tarfile's ``data`` filter, and on a Python 3.11 without it
(before 3.11.4, Debian 12's 3.11.2) by the same rules checked by hand: members outside the
destination, links out of it, devices and setuid bits never land."""

from __future__ import annotations

import io
import tarfile

import pytest

from arena_core.sources import safe_extractall


def archive(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            info.size = len(data or b"")
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def info(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, link: str = "") -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.type, member.mode, member.linkname = kind, mode, link
    return member


@pytest.fixture(params=["data_filter", "by_hand"])
def unpack(request, monkeypatch):
    if request.param == "by_hand":
        monkeypatch.delattr(tarfile, "data_filter", raising=True)

    def run(data: bytes, dest):
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            safe_extractall(tar, dest)
    return run


def test_files_directories_and_inner_links_land(unpack, tmp_path):
    unpack(archive((info("d", tarfile.DIRTYPE, 0o755), None), (info("d/a.txt", mode=0o4755), b"hi"),
                   (info("d/ln", tarfile.SYMTYPE, link="a.txt"), None)), tmp_path)
    assert (tmp_path / "d" / "a.txt").read_text() == "hi"
    assert (tmp_path / "d" / "ln").resolve() == (tmp_path / "d" / "a.txt").resolve()
    assert not (tmp_path / "d" / "a.txt").stat().st_mode & 0o4000  # no setuid


def test_an_absolute_name_lands_inside(unpack, tmp_path):
    unpack(archive((info("/etc/arena-evil-test"), b"x")), tmp_path)
    assert (tmp_path / "etc" / "arena-evil-test").read_text() == "x"


@pytest.mark.parametrize("bad", [
    (info("../escape.txt"), b"x"),
    (info("out", tarfile.SYMTYPE, link="/etc/passwd"), None),
    (info("up", tarfile.SYMTYPE, link="../../x"), None),
    (info("dev", tarfile.CHRTYPE), None),
])
def test_what_would_escape_is_refused(unpack, tmp_path, bad):
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(tarfile.TarError):
        unpack(archive(bad), dest)
    assert not (tmp_path / "escape.txt").exists()
