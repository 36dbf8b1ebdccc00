"""The trainer's current policy behind an OpenAI-compatible HTTP API, shaped like vLLM's.

Batched sampling, atomic weight swaps (``POST /v1/weights``), every answer tagged with its policy
version, optional registration in ``arena_backends``. Run ``python -m arena_rl.policy_server
--checkpoint ckpt.pt --port 9093``; endpoints and options: docs/rl.md ("Policy server").
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from arena_rl.generate import GenRequest, GenResult
from arena_rl.model import from_blob, load_checkpoint, new_policy
from arena_rl.openai_api import (
    BadRequest,
    CharEngine,
    Policy,
    StreamShaper,
    chat_prompt,
    chat_response,
    completion_prompt,
    completion_response,
    gen_request,
)
from arena_rl.tokenizer import DEFAULT_ALPHABET, CharTokenizer

log = logging.getLogger("arena_rl.policy_server")

VERSION_HEADER = "X-Arena-Policy-Version"


@dataclass
class _Pending:
    request: GenRequest
    future: asyncio.Future
    #: a stream's events: ("token", policy, id, logprob, top) as each is sampled, then ("end",)
    events: asyncio.Queue | None = None


class PolicyServer:
    """The batching engine; :func:`create_app` puts HTTP in front of it."""

    def __init__(self, policy: Policy, *, model_name: str = "arena-policy", max_batch: int = 32,
                 batch_wait_ms: float = 5.0, partial_rollouts: bool = False):
        self.policy = policy
        self.model_name = model_name
        self.max_batch = max_batch
        self.batch_wait_ms = batch_wait_ms
        self.batches = 0  # batches run, for tests and metrics
        self.largest_batch = 0
        self.on_swap: list = []  # async callables(version) run after every swap
        self._queue: asyncio.Queue[_Pending] | None = None
        self._task: asyncio.Task | None = None
        self._turn = asyncio.Lock()  # a batch or a weight update, never both at once
        #: partial rollouts: a weight update arriving during a batch is taken between two of its
        #: tokens (the generation goes on under the new policy) instead of waiting for its end
        self.partial_rollouts = partial_rollouts
        self._staged: tuple[bytes, int, asyncio.Future] | None = None

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._batcher())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def submit(self, request: GenRequest) -> tuple[GenResult, Policy]:
        return await self.enqueue(request)

    def enqueue(self, request: GenRequest, events: asyncio.Queue | None = None) -> asyncio.Future:
        """Queue ``request`` for the next batch; ``events`` gets its tokens as they are sampled."""
        if self._queue is None:
            raise RuntimeError("PolicyServer.start() was not awaited")
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(request, future, events))
        return future

    async def swap(self, blob: bytes, version: int | None = None) -> int:
        """New weights for every batch that starts from now on: a whole character-level policy
        (its blob carries its version), or a LoRA adapter for the served language model
        (``version`` required, above the current one). Never during a batch."""
        engine = self.policy.engine
        if isinstance(engine, CharEngine):
            model, tokenizer, version = await asyncio.to_thread(from_blob, blob)
            if tokenizer != engine.tokenizer:
                raise BadRequest("the pushed policy has a different tokenizer alphabet than the served one")
            async with self._turn:
                self.policy = Policy(CharEngine(model, tokenizer), version)
        else:
            if version is None:
                raise BadRequest(f"a LoRA adapter needs its policy version in the {VERSION_HEADER} header")
            if version <= self.policy.version or (self._staged is not None and version <= self._staged[1]):
                raise BadRequest(f"policy version {version} is not newer than the served {self.policy.version}")
            if self.partial_rollouts and self._turn.locked() and self._staged is None:
                self._staged = (blob, version, asyncio.get_running_loop().create_future())
                await self._staged[2]  # taken by the running batch, or after it (``_batcher``)
            else:
                async with self._turn:
                    await asyncio.to_thread(engine.load_adapter, blob)
                    self.policy = Policy(engine, version)
        log.info("now serving policy version %d", version)
        for hook in self.on_swap:
            await hook(version)
        return version

    async def _batcher(self) -> None:
        assert self._queue is not None
        while True:
            batch = [await self._queue.get()]
            deadline = time.monotonic() + self.batch_wait_ms / 1000
            while len(batch) < self.max_batch:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), timeout))
                except asyncio.TimeoutError:
                    break
            async with self._turn:
                await self._run(batch)
                if self._staged is not None:  # staged too late for the batch's tokens: taken now
                    await asyncio.to_thread(self._take_staged)
            for pending in batch:
                if pending.events is not None:
                    pending.events.put_nowait(("end",))

    def _take_staged(self) -> int | None:
        """In the generating thread (it holds the engine's lock): load the staged adapter and
        serve it from now on; its version, or None when nothing is staged or it failed."""
        staged, self._staged = self._staged, None
        if staged is None:
            return None
        blob, version, future = staged
        loop = future.get_loop()
        try:
            self.policy.engine.apply_adapter(blob)
        except Exception as exc:  # noqa: BLE001 - the push's answer says why; the generation goes on
            loop.call_soon_threadsafe(future.set_exception, BadRequest(str(exc)))
            return None
        self.policy = Policy(self.policy.engine, version)
        loop.call_soon_threadsafe(future.set_result, version)
        return version

    async def _run(self, batch: list[_Pending]) -> None:
        policy = self.policy  # read once: the whole batch runs on one version
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(batch))
        loop = asyncio.get_running_loop()

        def dispatch(group: list[_Pending]):
            def on_token(i: int, tok: int, lp: float, top: list) -> None:
                if group[i].events is not None:
                    loop.call_soon_threadsafe(group[i].events.put_nowait, ("token", policy, tok, lp, top))
            return on_token

        interrupt = self._take_staged if self.partial_rollouts else None
        try:
            results = await asyncio.to_thread(policy.engine.generate, [p.request for p in batch], dispatch(batch),
                                              interrupt)
        except ValueError:
            # one bad request must not fail its neighbours: run each alone to find it
            for pending in batch:
                try:
                    result = (await asyncio.to_thread(policy.engine.generate, [pending.request],
                                                      dispatch([pending]), interrupt))[0]
                    pending.future.set_result((result, policy))
                except ValueError as exc:
                    pending.future.set_exception(BadRequest(str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - surfaced to every waiting request
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(exc)
            return
        for pending, result in zip(batch, results, strict=True):
            if not pending.future.done():
                pending.future.set_result((result, policy))


# ----------------------------------------------------------------------------- HTTP


def create_app(server: PolicyServer) -> FastAPI:
    app = FastAPI(title="Arena policy server")

    def error(status: int, message: str, code: str = "invalid_request") -> Response:
        body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
        return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")

    def ok(payload: dict, version: int) -> Response:
        return Response(msgspec.json.encode(payload), media_type="application/json",
                        headers={VERSION_HEADER: str(version)})

    async def body_of(request: Request) -> dict:
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as exc:
            raise BadRequest(f"invalid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        return body

    async def serve(request: Request, prompt_of, respond) -> Response:
        try:
            body = await body_of(request)
            prompt_ids = prompt_of(server.policy.engine, body)
            gen = gen_request(body, prompt_ids)
            if body.get("stream"):
                return await stream(body, prompt_ids, gen, "chat" if prompt_of is chat_prompt else "completion")
            result, used = await server.submit(gen)
        except BadRequest as exc:
            return error(400, str(exc))
        answer = respond(body, prompt_ids, result, used, str(body.get("model") or server.model_name))
        return ok(answer, int(answer["policy_version"]))

    async def stream(body: dict, prompt_ids: list[int], gen: GenRequest, kind: str) -> Response:
        """Answered once the first token is sampled (a request the model refuses is still a 400)."""
        events: asyncio.Queue = asyncio.Queue()
        future = server.enqueue(gen, events)
        first = await events.get()
        if first[0] == "end":
            future.result()  # raises the request's error (BadRequest: a 400)
            raise BadRequest("the model produced no token")
        policy = first[1]
        shaper = StreamShaper(kind, body, policy, str(body.get("model") or server.model_name), prompt_ids)

        async def pieces():
            head = shaper.first()
            if head is not None:
                yield head
            item = first
            while item[0] == "token":
                yield shaper.token(item[2], item[3], item[4])
                item = await events.get()
            try:
                result, _ = future.result()
            except Exception as exc:  # noqa: BLE001 - the head is gone: the error goes as an event
                yield b"data: " + msgspec.json.encode({"error": {"message": str(exc), "type": "server_error"}}) + b"\n\n"
                return
            for piece in shaper.end(result):
                yield piece

        return StreamingResponse(pieces(), media_type="text/event-stream", headers={VERSION_HEADER: str(policy.version)})

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "policy_version": str(server.policy.version), "batches": server.batches,
                "largest_batch": server.largest_batch}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "owned_by": "arena",
                                            "created": 0, "policy_version": str(server.policy.version)}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve(request, chat_prompt, chat_response)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, completion_prompt, completion_response)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            body = await body_of(request)
            policy = server.policy  # one version for the whole answer
            if "messages" in body:
                ids = chat_prompt(policy.engine, body)
            elif isinstance(body.get("prompt"), str):
                ids = completion_prompt(policy.engine, body)
            else:
                raise BadRequest("/tokenize takes 'messages' (a chat) or 'prompt' (a string)")
        except BadRequest as exc:
            return error(400, str(exc))
        return ok({"count": len(ids), "max_model_len": policy.engine.max_len, "tokens": ids}, policy.version)

    @app.post("/v1/weights")
    async def weights(request: Request) -> Response:
        try:
            header = request.headers.get(VERSION_HEADER)
            if header is not None and not header.isdigit():
                raise BadRequest(f"{VERSION_HEADER} must be a non-negative integer")
            version = await server.swap(await request.body(), int(header) if header is not None else None)
        except (ValueError, BadRequest) as exc:
            return error(400, str(exc), "invalid_weights")
        return ok({"policy_version": str(version)}, version)

    return app


# ----------------------------------------------------------------------------- registration + main


class Registration:
    """This server's ``BackendReplica`` entry in the ``arena_backends`` KV bucket."""

    def __init__(self, nats_url: str, *, replica_id: str, url: str, model: str, heartbeat_s: float = 10.0):
        self.nats_url, self.replica_id, self.url, self.model = nats_url, replica_id, url, model
        self.heartbeat_s = heartbeat_s
        self._version = 0
        self._bus = None
        self._kv = None
        self._task: asyncio.Task | None = None

    async def start(self, version: int) -> None:
        from arena_core import subjects
        from arena_core.bus import Bus

        self._bus = await Bus.connect(self.nats_url, "policy-server")
        self._kv = await self._bus.kv(subjects.KV_BACKENDS)
        await self.put(version)
        self._task = asyncio.create_task(self._beat())

    async def put(self, version: int) -> None:
        from arena_core.schemas import BackendReplica

        self._version = version
        replica = BackendReplica(replica_id=self.replica_id, url=self.url, models=[],
                                 policy_version=str(version), registered_at=time.time())
        await self._kv.put(self.replica_id, msgspec.json.encode(replica))

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.put(self._version)
            except Exception as exc:  # noqa: BLE001 - NATS trouble: the next beat retries
                log.warning("re-registering %s failed: %s", self.replica_id, exc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._kv is not None:
            try:
                await asyncio.wait_for(self._kv.delete(self.replica_id), 3.0)
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                log.warning("unregistering %s failed: %s", self.replica_id, exc)
        if self._bus is not None:
            try:
                await asyncio.wait_for(self._bus.close(), 3.0)
            except Exception as exc:  # noqa: BLE001 - NATS already gone
                log.warning("closing the NATS connection failed: %s", exc)


def load_policy(args: argparse.Namespace) -> Policy:
    if args.engine == "smollm2":
        from arena_rl.lm import LanguageModel, LoRASpec

        lm = LanguageModel.load(lora=LoRASpec(r=args.lora_r, alpha=args.lora_alpha), max_len=args.lm_max_len)
        return Policy(lm, 0)
    if args.checkpoint:
        model, tokenizer, version = load_checkpoint(args.checkpoint)
    else:
        tokenizer = CharTokenizer(alphabet=args.alphabet)
        model = new_policy(tokenizer, seed=args.init_seed, d_model=args.d_model, n_layers=args.n_layers,
                           n_heads=args.n_heads, max_len=args.max_len)
        version = 0
    model.eval()
    return Policy(CharEngine(model, tokenizer), version)


async def _main(args: argparse.Namespace) -> None:
    import torch

    from arena_core.runtime import serve, stop_on_signals

    torch.set_num_threads(args.threads)
    server = PolicyServer(load_policy(args), model_name=args.model, max_batch=args.max_batch,
                          batch_wait_ms=args.batch_wait_ms, partial_rollouts=args.partial_rollouts)
    await server.start()
    registration = None
    if args.nats_url:
        url = args.public_url or f"http://{args.host}:{args.port}/v1"
        registration = Registration(args.nats_url, replica_id=args.replica_id or f"policy-{args.port}", url=url,
                                    model=args.model)
        await registration.start(server.policy.version)
        server.on_swap.append(registration.put)
    try:
        await serve(stop_on_signals(), app=create_app(server), host=args.host, port=args.port)
    finally:
        if registration is not None:
            await registration.stop()
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m arena_rl.policy_server", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("char", "smollm2"), default="char",
                        help="char: the demo's character-level policy; smollm2: SmolLM2-135M-Instruct with LoRA")
    parser.add_argument("--lora-r", type=int, default=16, help="smollm2: the LoRA adapter's rank")
    parser.add_argument("--lora-alpha", type=int, default=32)
    parser.add_argument("--lm-max-len", type=int, default=2048, help="smollm2: the context served")
    parser.add_argument("--partial-rollouts", action="store_true",
                        help="smollm2: a weight update interrupts running generations, which go on under it")
    parser.add_argument("--checkpoint", help="policy checkpoint (else a fresh policy from --init-seed)")
    parser.add_argument("--init-seed", type=int, default=0)
    parser.add_argument("--alphabet", default=DEFAULT_ALPHABET)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--n-layers", type=int, default=1)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9093)
    parser.add_argument("--model", default="arena-policy")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--nats-url", default="", help="register in the arena_backends KV bucket")
    parser.add_argument("--replica-id", default="", help="KV key (default policy-<port>)")
    parser.add_argument("--public-url", default="", help="base URL registered (default http://host:port/v1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        asyncio.run(_main(args))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"policy_server: {exc}") from None


if __name__ == "__main__":
    main()
