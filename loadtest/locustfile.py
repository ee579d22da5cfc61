"""locust users for kvferry: streamed requests at open-loop arrival times, over gRPC or HTTP.

    locust -f loadtest/locustfile.py --headless -u 64 -r 64 -H 127.0.0.1:50051 GenerateUser \\
        --rate 2 --duration 60 --input-len 256 --output-len 64 --records out.jsonl
    locust -f loadtest/locustfile.py --headless -u 64 -r 64 -H http://127.0.0.1:8000 OpenAIUser ...

`GenerateUser` streams the router's gRPC `Generate`; `OpenAIUser` streams `POST /v1/completions`
(SSE, token-id prompts, usage at the end) from any OpenAI-compatible server (kvferry's HTTP API,
vLLM, SGLang), so several servers can be measured with the same client.
Every user of the process takes the next send time from one shared schedule (gamma gaps; burstiness
1 = Poisson), sleeps until then and sends, so the offered rate is `--rate` in total whatever the user
count — as long as there are enough users to have every request in flight (the sweep sizes them).
A request's send time is its *scheduled* time, so a late client counts against TTFT too. Each request
becomes one JSONL record (send, first token, last token, output tokens, status, token times); the
run ends once every scheduled request has finished.
"""

from __future__ import annotations

import time

from grpc.experimental import gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any channel: gRPC's I/O must yield to gevent

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent  # noqa: E402
import grpc  # noqa: E402
import requests  # noqa: E402
from locust import User, events, task  # noqa: E402
from locust.exception import StopUser  # noqa: E402

from kvferry.loadtest.arrivals import ArrivalSchedule, arrival_offsets  # noqa: E402
from kvferry.loadtest.metrics import RequestRecord  # noqa: E402
from kvferry.loadtest.prompts import PromptSource  # noqa: E402
from kvferry.router.client import Client, build_request  # noqa: E402
from kvferry.settings import load_settings  # noqa: E402


def api_key() -> str | None:
    """The key requests carry: the first of $KVFERRY_API_KEY (`kvferry loadtest sweep --api-key` puts
    it there), None for none."""
    return load_settings().client_key


def auth_headers() -> dict[str, str]:
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    g = parser.add_argument_group("kvferry")
    g.add_argument("--rate", type=float, default=1.0, help="requests per second, all users together")
    g.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    g.add_argument("--input-len", type=int, default=256)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--prefix-share", type=float, default=0.0, help="fraction of each prompt shared by all")
    g.add_argument("--records", default="records.jsonl", help="JSONL output, one record per request")
    g.add_argument("--arrival-seed", type=int, default=0)
    g.add_argument("--request-timeout", type=float, default=300.0)
    g.add_argument(
        "--vocab-size", type=int, default=0, help="HTTP targets that do not report it (0 = ask the target)"
    )


class _Run:
    """What the users of one locust process share."""

    schedule: ArrivalSchedule | None = None
    prompts: PromptSource | None = None
    model: str = ""  # HTTP targets: the model name requests carry
    out = None
    outstanding = 0
    done = False


@events.test_start.add_listener
def _start(environment, **_) -> None:
    o = environment.parsed_options
    if environment.host.startswith(("http://", "https://")):
        _Run.model, vocab = openai_model(environment.host, o.vocab_size)
    else:
        with Client(environment.host, api_key=api_key()) as client:
            vocab = client.model_info(timeout=30).vocab_size
    _Run.prompts = PromptSource(vocab, o.input_len, o.prefix_share, seed=o.arrival_seed)
    offsets = arrival_offsets(o.rate, o.duration, o.burstiness, seed=o.arrival_seed)
    _Run.schedule = ArrivalSchedule(offsets, start=time.time() + 1.0)
    _Run.out = open(o.records, "w")  # noqa: SIM115 - closed at test_stop


@events.test_stop.add_listener
def _stop(environment, **_) -> None:
    if _Run.out is not None:
        _Run.out.close()
        _Run.out = None


def openai_model(base_url: str, vocab_size: int) -> tuple[str, int]:
    """(model name, vocabulary size) of an OpenAI-compatible server, from GET /v1/models: kvferry
    reports vocab_size; otherwise the model's config.json when `root` is a directory here (vLLM
    serving a local checkpoint), else `vocab_size` must be given."""
    reply = requests.get(base_url.rstrip("/") + "/v1/models", headers=auth_headers(), timeout=30)
    reply.raise_for_status()
    card = reply.json()["data"][0]
    vocab = vocab_size or card.get("vocab_size") or 0
    config = Path(str(card.get("root") or card["id"])) / "config.json"
    if not vocab and config.is_file():
        vocab = json.loads(config.read_text())["vocab_size"]
    if not vocab:
        raise RuntimeError(f"{base_url} does not report its vocabulary size: pass --vocab-size")
    return card["id"], int(vocab)


class _OpenLoopUser(User):
    """Sends one request at each of the schedule's times (no think time: arrivals are open-loop)."""

    abstract = True
    request_type = ""

    @task
    def generate(self) -> None:
        at = _Run.schedule.claim()
        if at is None:
            self._finish_run()
            raise StopUser()
        _Run.outstanding += 1  # claimed: the run is not over until it is answered
        record = RequestRecord(send=at)
        try:
            gevent.sleep(max(0.0, at - time.time()))
            o = self.environment.parsed_options
            prompt = _Run.prompts.prompt(_Run.prompts.next_index())
            error = self.send(record, prompt, o.output_len, o.request_timeout)
        finally:
            _Run.outstanding -= 1
        if _Run.out is not None:
            _Run.out.write(record.to_json() + "\n")
            _Run.out.flush()
        self.environment.events.request.fire(
            request_type=self.request_type,
            name="Generate",
            response_time=((record.last_token or time.time()) - at) * 1e3,
            response_length=record.output_tokens,
            exception=error,
            context={},
        )

    def send(self, record: RequestRecord, prompt: list[int], max_tokens: int, timeout: float):
        """Stream one greedy request into `record`; returns the error, if any."""
        raise NotImplementedError

    def _finish_run(self) -> None:
        """The schedule is used up: end the run once the last request in flight is done."""
        if _Run.done:
            return
        _Run.done = True

        def wait_and_quit() -> None:
            while _Run.outstanding > 0:
                gevent.sleep(0.1)
            self.environment.runner.quit()

        gevent.spawn(wait_and_quit)


class GenerateUser(_OpenLoopUser):
    """The router's gRPC `Generate` stream."""

    request_type = "grpc"

    def on_start(self) -> None:
        self.client = Client(self.host, api_key=api_key())

    def on_stop(self) -> None:
        self.client.close()

    def send(self, record: RequestRecord, prompt: list[int], max_tokens: int, timeout: float):
        request = build_request(
            prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        try:
            for message in self.client.stream(request, timeout=timeout):
                if message.token_ids:
                    record.token_arrived(time.time(), len(message.token_ids))
        except grpc.RpcError as err:
            record.status = err.code().name
            return err
        return None


class OpenAIUser(_OpenLoopUser):
    """`POST /v1/completions` with `stream: true` on any OpenAI-compatible server: one token time per
    chunk that carries a choice; the output length from the closing usage chunk."""

    request_type = "http"

    def on_start(self) -> None:
        self.session = requests.Session()
        self.session.headers.update(auth_headers())
        self.url = self.host.rstrip("/") + "/v1/completions"

    def on_stop(self) -> None:
        self.session.close()

    def send(self, record: RequestRecord, prompt: list[int], max_tokens: int, timeout: float):
        body = {
            "model": _Run.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            with self.session.post(self.url, json=body, stream=True, timeout=timeout) as reply:
                if reply.status_code != 200:
                    record.status = f"HTTP_{reply.status_code}"
                    return RuntimeError(f"HTTP {reply.status_code}: {reply.text[:200]}")
                chunks = 0
                for line in reply.iter_lines(chunk_size=None):
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        record.status = "STREAM_ERROR"
                        return RuntimeError(str(event["error"]))
                    if event.get("choices"):
                        chunks += 1
                        record.token_arrived(time.time(), 0)
                    elif event.get("usage"):
                        record.output_tokens = event["usage"]["completion_tokens"]
                if not record.output_tokens:
                    record.output_tokens = chunks  # a server that sent no usage: one token a chunk
        except (requests.RequestException, ValueError) as err:
            record.status = type(err).__name__
            return err
        return None
