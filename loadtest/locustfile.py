"""locust user for kvferry: streamed gRPC `Generate` calls at open-loop arrival times.

    locust -f loadtest/locustfile.py --headless -u 64 -r 64 -H 127.0.0.1:50051 \\
        --rate 2 --duration 60 --input-len 256 --output-len 64 --records out.jsonl

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

import gevent  # noqa: E402
import grpc  # noqa: E402
from locust import User, events, task  # noqa: E402
from locust.exception import StopUser  # noqa: E402

from kvferry.loadtest.arrivals import ArrivalSchedule, arrival_offsets  # noqa: E402
from kvferry.loadtest.metrics import RequestRecord  # noqa: E402
from kvferry.loadtest.prompts import PromptSource  # noqa: E402
from kvferry.router.client import Client, build_request  # noqa: E402


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


class _Run:
    """What the users of one locust process share."""

    schedule: ArrivalSchedule | None = None
    prompts: PromptSource | None = None
    out = None
    outstanding = 0
    done = False


@events.test_start.add_listener
def _start(environment, **_) -> None:
    o = environment.parsed_options
    with Client(environment.host) as client:
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


class GenerateUser(User):
    """Sends Generate streams at the schedule's times (no think time: arrivals are open-loop)."""

    def on_start(self) -> None:
        self.client = Client(self.host)

    def on_stop(self) -> None:
        self.client.close()

    @task
    def generate(self) -> None:
        at = _Run.schedule.claim()
        if at is None:
            self._finish_run()
            raise StopUser()
        _Run.outstanding += 1  # claimed: the run is not over until it is answered
        record, error = RequestRecord(send=at), None
        try:
            gevent.sleep(max(0.0, at - time.time()))
            o = self.environment.parsed_options
            request = build_request(
                prompt_token_ids=_Run.prompts.prompt(_Run.prompts.next_index()),
                max_tokens=o.output_len,
                temperature=0.0,
                ignore_eos=True,
            )
            for message in self.client.stream(request, timeout=o.request_timeout):
                now = time.time()
                if message.token_ids:
                    record.token_times.append(now)
                    record.output_tokens += len(message.token_ids)
                    if record.first_token is None:
                        record.first_token = now
                    record.last_token = now
        except grpc.RpcError as err:
            record.status, error = err.code().name, err
        finally:
            _Run.outstanding -= 1
        if _Run.out is not None:
            _Run.out.write(record.to_json() + "\n")
            _Run.out.flush()
        self.environment.events.request.fire(
            request_type="grpc",
            name="Generate",
            response_time=((record.last_token or time.time()) - at) * 1e3,
            response_length=record.output_tokens,
            exception=error,
            context={},
        )

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
