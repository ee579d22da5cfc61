"""`kvferry` command line.

kvferry model create NAME        write a built-in model (seeded weights + tokenizer) to the cache
kvferry generate                 offline generation in this process, or against a running cluster (--server)
kvferry eval                     held-out perplexity through the engine (default model: trained)
kvferry up                       start a whole cluster: local processes, or on Ray (--ray)
kvferry scale                    set the number of prefill / decode groups of a running cluster
kvferry plan                     recommend prefill / decode group counts for a recorded request trace
kvferry down                     stop a cluster started with --detach on Ray
kvferry loadtest sweep           open-loop load test over request rates: goodput, plots
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvferry.engine.engine import EngineConfig, EngineConfigError, LLMEngine
from kvferry.engine.output import Completion
from kvferry.engine.request import InvalidRequestError, SamplingParams
from kvferry.flags import add_config_args, config_from
from kvferry.model.config import ModelConfigError
from kvferry.model.corpus import SPLITS
from kvferry.model.create import SPECS


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvferry.deploy.config import ClusterConfigError

    try:
        return args.func(args)
    except (InvalidRequestError, ModelConfigError, EngineConfigError, ClusterConfigError) as err:
        print(f"kvferry: error: {err}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvferry", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _model_parser(sub)
    _generate_parser(sub)
    _eval_parser(sub)
    _up_parser(sub)
    _scale_parser(sub)
    _plan_parser(sub)
    _down_parser(sub)
    _loadtest_parser(sub)
    return parser


def _loadtest_parser(sub) -> None:
    from kvferry.loadtest.sweep import add_sweep_args

    lt = sub.add_parser("loadtest", help="load tests (locust, open-loop arrivals)")
    lsub = lt.add_subparsers(dest="loadtest_command", required=True)
    sweep = lsub.add_parser(
        "sweep", help="run locust once per request rate; report SLO attainment, goodput, CSV/JSON/PNG"
    )
    add_sweep_args(sweep)
    sweep.set_defaults(func=_cmd_loadtest_sweep)


def _cmd_loadtest_sweep(args) -> int:
    from kvferry.loadtest.sweep import run_sweep

    report = run_sweep(args)
    for label, result in report["targets"].items():
        print(f"{label} ({result['target']}): goodput {result['goodput']:.2f} req/s")
    print(f"results in {args.out}: sweep.csv, summary.json, attainment.png, latency.png")
    return 0


def _model_parser(sub) -> None:
    model = sub.add_parser("model", help="manage built-in deterministic models")
    msub = model.add_subparsers(dest="model_command", required=True)
    create = msub.add_parser("create", help="write a built-in model (seeded weights + trained tokenizer)")
    create.add_argument(
        "name", choices=SPECS, help="trained: trained here on the standard library (minutes, once)"
    )
    create.add_argument("--out", type=Path, help="directory (default: the model cache)")
    create.add_argument("--seed", type=int, default=0)
    create.set_defaults(func=_cmd_model_create)


def _cmd_model_create(args) -> int:
    from kvferry.model.create import create_model
    from kvferry.settings import load_settings

    out = args.out or load_settings().models_dir / args.name
    if (out / "config.json").exists():
        print(f"{out} already exists", file=sys.stderr)
        return 0
    create_model(args.name, out, seed=args.seed)
    print(out)
    return 0


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-ids", default="", help="comma-separated token ids")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_params_from(args, overrides: dict | None = None) -> SamplingParams:
    values = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": tuple(args.stop),
        "stop_token_ids": _int_list(args.stop_token_ids),
        "ignore_eos": args.ignore_eos,
    }
    for key, value in (overrides or {}).items():
        if key not in values:
            raise InvalidRequestError(f"unknown sampling field {key!r}")
        if key == "stop" and isinstance(value, str):
            value = [value]
        values[key] = tuple(value) if isinstance(value, list) else value
    return SamplingParams(**values)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidRequestError(f"expected comma-separated integers, got {text!r}") from None


def _generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate completions (streams text to the terminal)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-token-ids", help="comma-separated token ids")
    src.add_argument(
        "--prompts-file", type=Path, help="JSONL: prompt or prompt_token_ids (+ sampling fields)"
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object per request")
    gen.add_argument("--server", metavar="HOST:PORT", help="send to a running cluster's router instead")
    gen.add_argument("--timeout", type=float, default=None, help="per-request deadline in seconds (--server)")
    _client_auth_args(gen)
    add_config_args(gen, EngineConfig)
    add_sampling_args(gen)
    gen.set_defaults(func=_cmd_generate)


def _cmd_generate(args) -> int:
    params = sampling_params_from(args)
    if args.server:
        return _generate_remote(args, params)
    engine = LLMEngine(config_from(args, EngineConfig))
    if args.prompts_file:
        requests = _read_prompts(args.prompts_file, args)
        for done in engine.generate(requests, use_tqdm=True):
            print(json.dumps(done.to_json()) if args.json else done.text, flush=True)
        return 0
    ids = list(_int_list(args.prompt_token_ids)) if args.prompt_token_ids else None
    request_id = engine.add_request(args.prompt, params, prompt_token_ids=ids)
    req = engine.states[request_id].req
    pieces = []
    for out in engine.outputs_of(request_id):
        pieces.append(out.text)
        if not args.json:
            print(out.text, end="", flush=True)
    if args.json:
        done = Completion(
            request_id,
            req.prompt_token_ids,
            req.output_token_ids,
            "".join(pieces),
            out.finish_reason,
            req.num_cached_tokens,
        )
        print(json.dumps(done.to_json()))
    else:
        print(f"\n[finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def _eval_parser(sub) -> None:
    ev = sub.add_parser(
        "eval",
        help="held-out perplexity through the engine (the standard library's held-out split)",
        description="Perplexity of the model on the held-out split of the Python standard library sources "
        "(the files `kvferry model create trained` did not train on), scored by the engine in windows of "
        "--context tokens with the engine settings given. Prints one JSON object.",
    )
    ev.add_argument("--context", type=int, default=256, help="tokens per scored window")
    ev.add_argument("--max-eval-tokens", type=int, default=32768, help="held-out tokens to score (at most)")
    ev.add_argument("--split", default="heldout", choices=SPLITS)
    add_config_args(ev, EngineConfig)
    ev.set_defaults(func=_cmd_eval, model="trained")


def _cmd_eval(args) -> int:
    from kvferry.evaluate import heldout_tokens, perplexity

    engine = LLMEngine(config_from(args, EngineConfig))
    tokens = heldout_tokens(engine, args.max_eval_tokens, args.split)
    try:
        result = perplexity(engine, tokens, args.context, progress=True)
    except ValueError as err:  # --context out of range, or nothing to score
        print(f"kvferry: error: {err}", file=sys.stderr)
        return 2
    info = {"model": args.model, "split": args.split, "dtype": str(engine.dtype).removeprefix("torch.")}
    quant = {"quantization": engine.quantization} if engine.quantization else {}
    print(json.dumps({**info, "kernels": engine.kernel_backend, **quant, **result}))
    return 0


def _read_prompts(path: Path, args) -> list[dict]:
    requests = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise InvalidRequestError(f"{path}:{line_no}: not JSON ({err})") from None
        prompt, ids = item.pop("prompt", None), item.pop("prompt_token_ids", None)
        if prompt is None and ids is None:
            raise InvalidRequestError(f"{path}:{line_no}: needs 'prompt' or 'prompt_token_ids'")
        requests.append(
            {"prompt": prompt, "prompt_token_ids": ids, "params": sampling_params_from(args, item)}
        )
    return requests


def _client_auth_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        default=None,
        help="with --server: the router's API key (default: the first of KVFERRY_API_KEY); "
        "prefer the variable, a flag shows in ps",
    )
    p.add_argument(
        "--ssl-ca-certs",
        type=Path,
        default=None,
        help="with --server: the router serves TLS; PEM roots to trust",
    )


def _router_client(target: str, api_key: str | None, ca_certs: Path | None):
    """A router client that sends `api_key` (else the environment's) and trusts `ca_certs` (TLS)."""
    from kvferry.router.client import Client
    from kvferry.settings import load_settings

    key = api_key or load_settings().client_key
    auth = {"api_key": key} if key else {}
    if ca_certs is not None:
        auth["root_certificates"] = ca_certs.read_bytes()
    return Client(target, **auth)


def _generate_remote(args, params: SamplingParams) -> int:
    """`kvferry generate --server`: the same flags, answered by a cluster over gRPC."""
    import grpc

    from kvferry.router.client import build_request

    if args.prompts_file:
        requests = _read_prompts(args.prompts_file, args)
    else:
        ids = list(_int_list(args.prompt_token_ids)) if args.prompt_token_ids else None
        requests = [{"prompt": args.prompt, "prompt_token_ids": ids, "params": params}]
    with _router_client(args.server, args.api_key, args.ssl_ca_certs) as client:
        for item in requests:
            p: SamplingParams = item["params"]
            request = build_request(
                item["prompt"],
                item["prompt_token_ids"],
                max_tokens=p.max_tokens,
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                seed=p.seed,
                stop=p.stop,
                stop_token_ids=p.stop_token_ids,
                ignore_eos=p.ignore_eos,
            )
            ids, pieces, finished, rid = [], [], None, ""
            try:
                for msg in client.stream(request, timeout=args.timeout):
                    rid = msg.request_id
                    ids += msg.token_ids
                    pieces.append(msg.text)
                    if not args.json:
                        print(msg.text, end="", flush=True)
                    if msg.HasField("finished"):
                        finished = msg.finished
            except grpc.RpcError as err:
                print(f"\nkvferry: error: {err.code().name}: {err.details()}", file=sys.stderr)
                return 2 if err.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
            if args.json:
                print(
                    json.dumps(
                        {
                            "request_id": rid,
                            "output_token_ids": ids,
                            "text": "".join(pieces),
                            "finish_reason": finished.finish_reason,
                            "prompt_tokens": finished.prompt_tokens,
                            "cached_tokens": finished.cached_tokens,
                            "timings_ms": {
                                f.name: getattr(finished.timings, f.name)
                                for f in finished.timings.DESCRIPTOR.fields
                            },
                        }
                    ),
                    flush=True,
                )
            else:
                t = finished.timings
                print(
                    f"\n[finish_reason={finished.finish_reason} prompt={finished.prompt_tokens} "
                    f"output={finished.output_tokens} cached={finished.cached_tokens} "
                    f"ttft={t.ttft_ms:.0f}ms e2e={t.e2e_ms:.0f}ms]",
                    file=sys.stderr,
                )
    return 0


def _up_parser(sub) -> None:
    from kvferry.deploy.config import add_up_args

    up = sub.add_parser(
        "up",
        help="start a whole cluster (redis, pool, prefill, decode, router) locally, or on Ray (--ray)",
        usage="kvferry up [--config FILE] [SETTING FLAGS] [--ray [--address A] [--detach]] [--prompt TEXT]",
        description="Every setting flag below overrides the cluster file's value (--config); their names "
        "are the config fields' (deploy.config): the router's as they are (vLLM's spellings), the others "
        "under their section's prefix.",
    )
    up.add_argument("--config", type=Path, metavar="FILE", help="cluster YAML (see deploy/config.py)")
    up.add_argument(
        "--cluster-secret-file",
        type=Path,
        default=None,
        help="the internal plane's secret (default: the config's cluster_secret, else a new one)",
    )
    up.add_argument("--log-dir", type=Path, default=None, help="component logs (default: a temp dir)")
    up.add_argument(
        "--ray", action="store_true", help="launch on a Ray cluster (placement groups; see deploy/)"
    )
    up.add_argument(
        "--address", default=None, help="with --ray: the Ray cluster (default: RAY_ADDRESS, or a local one)"
    )
    up.add_argument(
        "--detach",
        action="store_true",
        help="with --ray: leave the cluster running when this command ends (kvferry down --ray stops it)",
    )
    prompt = up.add_argument_group("one-shot")
    prompt.add_argument("--prompt", help="stream this prompt's completion through the cluster, then stop")
    add_sampling_args(prompt)
    add_up_args(up)
    up.set_defaults(func=_cmd_up)


def _cmd_up(args) -> int:
    from dataclasses import replace

    from kvferry.deploy.config import ClusterConfigError, load_cluster_config, up_settings
    from kvferry.deploy.local import LaunchError, LocalCluster
    from kvferry.deploy.local_control import run_until_signal
    from kvferry.kvpool.metadata import mask_url
    from kvferry.settings import load_settings

    secret = None
    if args.cluster_secret_file is not None:
        try:
            secret = args.cluster_secret_file.read_text().strip() or None
        except OSError as err:
            raise ClusterConfigError(f"--cluster-secret-file: {err}") from None
        if secret is None:
            raise ClusterConfigError(f"--cluster-secret-file: {args.cluster_secret_file} is empty")
    values = {dest: getattr(args, dest) for dest in up_settings()}
    values["api_key"] = values["api_key"] or load_settings().api_keys or None
    cfg = load_cluster_config(args.config).with_overrides(**values)
    if secret is not None:
        cfg = replace(cfg, cluster_secret=secret)
    if args.ray:
        return _up_ray(args, cfg)
    if args.detach or args.address:
        print("kvferry: error: --address and --detach go with --ray", file=sys.stderr)
        return 2
    cluster = LocalCluster(cfg, log_dir=args.log_dir)
    try:
        addr = cluster.start()
    except LaunchError as err:
        cluster.stop()
        print(f"kvferry: error: {err}", file=sys.stderr)
        return 1
    except BaseException:
        cluster.stop()
        raise
    try:
        http = f", OpenAI API at {cluster.http_url}/v1" if cluster.http_url else ""
        fleet = cluster.live_routers()
        if len(fleet) > 1:  # one address (SO_REUSEPORT): the kernel spreads connections among them
            names = ", ".join(f"{c.name} (pid {c.proc.pid})" for c in fleet)
            print(f"kvferry: {len(fleet)} routers share {addr}{http}: {names}", file=sys.stderr, flush=True)
        print(
            f"kvferry cluster ready: router at {addr} (redis {mask_url(cluster.redis_url)}{http}, logs in "
            f"{cluster.log_dir})",
            flush=True,
        )
        print(
            f"kvferry: secrets in {cluster.log_dir} (owner-only, removed at stop): cluster-secret"
            + ("" if cfg.redis_url else ", redis-url (kvferry scale --redis-url-file)")
            + ("" if cluster.ca is None else ", tls-ca.pem, tls-cert.pem, tls-key.pem (internal TLS)"),
            file=sys.stderr,
            flush=True,
        )
        if args.prompt is None:
            run_until_signal(cluster)
            print("kvferry: shutting down", file=sys.stderr, flush=True)
            return 0
        return _prompt_once(args, addr, cfg)
    finally:
        cluster.stop()


def _prompt_once(args, addr: str, cfg) -> int:
    args.server, args.prompts_file, args.prompt_token_ids, args.json, args.timeout = (
        addr,
        None,
        None,
        False,
        None,
    )
    from kvferry.settings import bare_keys

    args.api_key = next(iter(bare_keys(cfg.router.api_keys)), None)
    args.ssl_ca_certs = Path(cfg.router.ssl_certfile) if cfg.router.ssl_certfile else None
    return _generate_remote(args, sampling_params_from(args))


def _up_ray(args, cfg) -> int:
    from dataclasses import replace

    from kvferry.deploy import ray_launch

    if args.log_dir is not None:
        cfg = replace(cfg, ray=replace(cfg.ray, log_dir=str(args.log_dir)))
    say = lambda line: print(f"kvferry: {line}", file=sys.stderr, flush=True)  # noqa: E731
    # a detached cluster needs a Ray that outlives this command: an existing one, never a private one
    # (the controller's events are printed here; its own log would repeat them)
    address = args.address or cfg.ray.address or ("auto" if args.detach else None)
    try:
        ray_launch.connect(address, log_to_driver=False)
        ctrl, status = ray_launch.up(cfg, detach=args.detach, say=say)
    except ray_launch.LaunchError as err:
        print(f"kvferry: error: {err}", file=sys.stderr)
        return 1
    addr = status["router"]
    http = f"OpenAI API at {status['http']}/v1, " if status.get("http") else ""
    print(
        f"kvferry cluster ready: router at {addr} ({http}Ray controller "
        f"{ray_launch.controller_name(cfg.namespace)}, logs in {status['log_dir']} on each node)",
        flush=True,
    )
    if args.detach and args.prompt is None:
        return 0
    try:
        if args.prompt is not None:
            return _prompt_once(args, addr, cfg)
        ray_launch.run_until_signal(ctrl, say)
        print("kvferry: shutting down", file=sys.stderr, flush=True)
        return 0
    finally:
        if not args.detach:
            ray_launch.down(ctrl)


def _scale_parser(sub) -> None:
    sc = sub.add_parser(
        "scale",
        help="change the number of prefill / decode groups or routers of a running cluster (in flight "
        "finish)",
    )
    sc.add_argument("--prefill", type=int, default=None, help="prefill groups wanted")
    sc.add_argument("--decode", type=int, default=None, help="decode groups wanted")
    sc.add_argument(
        "--routers", type=int, default=None, help="routers wanted (a leaving one finishes its streams)"
    )
    _control_args(sc)
    sc.set_defaults(func=_cmd_scale)


def _plan_parser(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="recommend prefill / decode group counts for a recorded request trace (the planner's model)",
    )
    plan.add_argument(
        "--trace",
        type=Path,
        required=True,
        help="JSONL, one request a line: arrival_s, prompt_tokens, output_tokens (cached_tokens optional)",
    )
    plan.add_argument("--window-s", type=float, default=60.0, help="the trace is planned a window at a time")
    from kvferry.deploy.planner import DEFAULT_TOKEN_BUDGET, AutoscaleSettings

    targets = ("max_groups", "ttft_ms", "tpot_ms", "utilization")  # the planner's own settings
    add_config_args(plan, AutoscaleSettings, only=targets)
    costs = plan.add_argument_group(
        "step costs (the first given: a live cluster's fits, these figures, or measured here on --model)"
    )
    costs.add_argument(
        "--prefill-cost", default=None, metavar="FIXED,PER_TOKEN,PER_KPAIR", help="prefill step model (ms)"
    )
    costs.add_argument("--decode-cost", default=None, metavar="FIXED,PER_TOKEN,PER_KPAIR", help="decode (ms)")
    # the workers' engine settings the costs are priced with (prefill: its step's token budget)
    fleet = ("model", "dtype", "max_num_batched_tokens", "decode_step_interval_ms", "max_num_seqs")
    add_config_args(costs, EngineConfig, only=fleet)
    # the names these flags had before they were derived from the configs (scripts still pass them)
    for old, dest in (
        ("--slo-ttft-ms", "ttft_ms"),
        ("--slo-tpot-ms", "tpot_ms"),
        ("--token-budget", "max_num_batched_tokens"),
        ("--decode-pace-ms", "decode_step_interval_ms"),
    ):
        plan.add_argument(old, dest=dest, type=float if dest.endswith("_ms") else int, help=argparse.SUPPRESS)
    costs.set_defaults(model="bench", max_num_batched_tokens=DEFAULT_TOKEN_BUDGET)
    _local_cluster_args(costs)  # a running cluster: its workers' fits
    plan.set_defaults(func=_cmd_plan)


def _cmd_plan(args) -> int:
    from kvferry.deploy import planner
    from kvferry.engine.cost_model import StepCost

    try:
        with args.trace.open() as f:
            rows = planner.read_trace(f)
    except (OSError, ValueError) as err:
        print(f"kvferry: error: --trace: {err}", file=sys.stderr)
        return 2
    targets = planner.PlanTargets(
        ttft_ms=args.ttft_ms or planner.DEFAULT_TTFT_MS,
        tpot_ms=args.tpot_ms or planner.DEFAULT_TPOT_MS,
        utilization=args.utilization,
    )
    if not 0 < targets.utilization <= 1 or targets.ttft_ms <= 0 or targets.tpot_ms <= 0 or args.window_s <= 0:
        print("kvferry: error: targets and --window-s must be > 0, --utilization in (0, 1]", file=sys.stderr)
        return 2
    redis_url = _redis_url(args)
    source = ""
    if redis_url:  # a running cluster: its workers' own fits
        from kvferry.kvpool.metadata import MetadataStore, mask_url

        meta = MetadataStore(redis_url, args.namespace)
        beats = {role: meta.members(role) for role in ("prefill", "decode")}
        if any(b is None for b in beats.values()):
            print(f"kvferry: error: cannot read the registry on {mask_url(redis_url)}", file=sys.stderr)
            return 1
        prefill = planner.RoleLoad.from_beats(list(beats["prefill"].values()))
        decode = planner.RoleLoad.from_beats(list(beats["decode"].values()))
        if prefill.cost is None or decode.cost is None:
            print(
                "kvferry: error: the cluster's workers have not fitted their step costs yet", file=sys.stderr
            )
            return 1
        source = f"the workers of namespace {args.namespace!r}"
    else:
        parsed = {}
        for role in ("prefill", "decode"):
            text = getattr(args, f"{role}_cost")
            if text is not None:
                parsed[role] = StepCost.from_list(text.split(","))
                if parsed[role] is None:
                    print(f"kvferry: error: --{role}-cost must be three numbers >= 0", file=sys.stderr)
                    return 2
        if len(parsed) < 2:
            measured = planner.calibrate(args.model, args.dtype, say=lambda s: print(s, file=sys.stderr))
            parsed = {"prefill": measured, "decode": measured} | parsed
            source = f"measured here on {args.model}"
        else:
            source = "given"
        prefill = planner.RoleLoad(cost=parsed["prefill"], budget=args.max_num_batched_tokens)
        decode = planner.RoleLoad(
            cost=parsed["decode"], pace_ms=args.decode_step_interval_ms or 0.0, max_num_seqs=args.max_num_seqs
        )
    try:
        plan = planner.plan_trace(rows, prefill, decode, targets, args.window_s, args.max_groups)
    except ValueError as err:
        print(f"kvferry: error: {err}", file=sys.stderr)
        return 2
    plan["costs"] = {"source": source, "prefill": prefill.cost.to_list(), "decode": decode.cost.to_list()}
    plan["slo"] = {"ttft_ms": targets.ttft_ms, "tpot_ms": targets.tpot_ms, "utilization": targets.utilization}
    for w in plan["windows"]:
        print(
            f"{w['start_s']:>8.0f}s  {w['requests']:>6} req  {w['arrival_rps']:>7.2f} req/s  prompt "
            f"{w['prompt_tokens']:>7.0f}  output {w['output_tokens']:>6.0f}  ->  prefill {w['prefill']} "
            f"({w['prefill_need']:.2f})  decode {w['decode']} ({w['decode_need']:.2f})",
            file=sys.stderr,
        )
    fixed = plan["fixed"]
    print(f"recommended: prefill {fixed['prefill']}, decode {fixed['decode']}", file=sys.stderr)
    print(json.dumps(plan))
    return 0


def _down_parser(sub) -> None:
    down = sub.add_parser("down", help="stop a cluster started with kvferry up --ray --detach")
    _control_args(down)
    down.set_defaults(func=_cmd_down)


def _control_args(p) -> None:
    p.add_argument("--ray", action="store_true", help="the cluster runs on Ray (kvferry up --ray)")
    p.add_argument(
        "--address", default=None, help="the Ray cluster (default: RAY_ADDRESS, or the one running here)"
    )
    _local_cluster_args(p)


def _local_cluster_args(p) -> None:
    p.add_argument("--namespace", default="default", help="the cluster's namespace")
    p.add_argument("--redis-url", default=None, help="a local cluster (kvferry up): its Redis URL")
    p.add_argument(
        "--redis-url-file",
        type=Path,
        default=None,
        help="a local cluster: the file with its Redis URL (<log dir>/redis-url: no password in ps)",
    )


def _redis_url(args) -> str | None:
    """--redis-url, or the URL read from --redis-url-file. A local cluster with internal TLS writes its
    launcher's leaf beside that file: this process takes it (unless it has one) to check redis-server's
    certificate and to call the internal ports."""
    if args.redis_url_file is None:
        return args.redis_url
    from kvferry.auth import TLS_ENVS, tls_material
    from kvferry.deploy.local import TLS_FILES

    url = args.redis_url_file.read_text().strip()
    beside = [args.redis_url_file.parent / name for name in TLS_FILES]
    if url.startswith("rediss://") and tls_material() is None and all(p.exists() for p in beside):
        os.environ.update({env: p.read_text() for env, p in zip(TLS_ENVS, beside, strict=True)})
    return url


def _ray_controller(args):
    """The controller of a running `kvferry up --ray` cluster (None after printing why there is none)."""
    from kvferry.deploy import ray_launch

    try:
        ray_launch.connect(args.address or "auto", log_to_driver=False)  # an existing Ray only
        return ray_launch.get_controller(args.namespace)
    except ray_launch.LaunchError as err:
        print(f"kvferry: error: {err}", file=sys.stderr)
        return None


def _cmd_scale(args) -> int:
    if args.ray:
        import ray

        from kvferry.deploy import ray_launch

        ctrl = _ray_controller(args)
        if ctrl is None:
            return 2
        try:
            status = ray.get(
                ctrl.scale.remote(prefill=args.prefill, decode=args.decode, routers=args.routers)
            )
        except ValueError as err:  # a count the controller refused
            print(f"kvferry: error: {err}", file=sys.stderr)
            return 2
        except ray_launch.RayTaskError as err:
            print(f"kvferry: error: {err.cause if getattr(err, 'cause', None) else err}", file=sys.stderr)
            return 1
        print(json.dumps(status, indent=2))
        return 0
    from kvferry.deploy.local_control import request_scale

    redis_url = _redis_url(args)
    if not redis_url:
        print(
            "kvferry: error: give --ray, or --redis-url / --redis-url-file of a local cluster",
            file=sys.stderr,
        )
        return 2
    return request_scale(redis_url, args.namespace, args.prefill, args.decode, routers=args.routers)


def _cmd_down(args) -> int:
    if not args.ray:
        print(
            "kvferry: error: a local cluster stops with its kvferry up (Ctrl-C); down is for --ray",
            file=sys.stderr,
        )
        return 2
    from kvferry.deploy import ray_launch

    ctrl = _ray_controller(args)
    if ctrl is None:
        return 2
    ray_launch.down(ctrl)
    print(f"kvferry: cluster {args.namespace!r} stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
