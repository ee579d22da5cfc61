"""`kvferry` command line: model creation and offline generation."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from kvferry.decode_worker.engine import EngineConfig, EngineConfigError, LLMEngine
from kvferry.decode_worker.output import Completion
from kvferry.decode_worker.request import InvalidRequestError, SamplingParams
from kvferry.model.config import ModelConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _model_parser(sub)
    _generate_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (InvalidRequestError, ModelConfigError, EngineConfigError) as err:
        print(f"kvferry: error: {err}", file=sys.stderr)
        return 2


def _model_parser(sub) -> None:
    model = sub.add_parser("model", help="manage built-in deterministic models")
    msub = model.add_subparsers(dest="model_command", required=True)
    create = msub.add_parser("create", help="write a built-in model (seeded weights + trained tokenizer)")
    create.add_argument("name", choices=["tiny", "bench"])
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


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=d.model, help="checkpoint directory, or a built-in name (tiny, bench)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks)
    p.add_argument("--kv-cache-memory-gib", type=float, default=d.kv_cache_memory_gib)
    p.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching
    )
    p.add_argument("--engine-seed", type=int, default=d.seed, help="seed for requests that give none")


def engine_config_from(args) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and k != "seed"}
    return EngineConfig(**values, seed=args.engine_seed)


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
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=_cmd_generate)


def _cmd_generate(args) -> int:
    engine = LLMEngine(engine_config_from(args))
    params = sampling_params_from(args)
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


if __name__ == "__main__":
    sys.exit(main())
