"""Sandbox providers: the interface (``provider``) and its implementations (``local_provider`` on
bubblewrap, ``docker_provider``, ``mock_provider``), shared by the sandbox and verification planes.
See docs/sandbox.md.
"""
