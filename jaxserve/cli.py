"""The `jaxserve` command: `serve` (the OpenAI-compatible server), `generate` and `run-batch` (offline), `convert`
(HF safetensors to Orbax), `compile` (the GPU step programs built for a GPU target on any machine, and audited,
or any target's kept in a program store for `serve --compiled`).

Bad input ends in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

from jaxserve.device_memory import claim_device_memory
from jaxserve.errors import ConfigError, JaxserveError
from jaxserve.config import FIELD_NAMES, EngineConfig, flag_fields, flag_type, load_config

DEMO_PROMPT = "The capital of France is"
# The titles of the flags' groups in `--help` (and in the generated flags pages).
ENGINE_GROUP, SERVER_GROUP, PROCESS_GROUP_GROUP = "engine", "server", "multi-host"

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, which lists its flags, rather than the top level's
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.handler(args)
    except JaxserveError as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2


def _build_parser() -> argparse.ArgumentParser:
    # No abbreviations: a misspelt flag (--max-num-seq) must be an error, not silently another flag.
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM inference on JAX/XLA.", allow_abbrev=False)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve the OpenAI API over HTTP", allow_abbrev=False)
    serve.add_argument("model_path", nargs="?", metavar="MODEL",
                       help="HF or converted folder (default: the built-in tiny random model)")
    _add_engine_flags(serve)
    _add_server_flags(serve)
    _add_process_group_flags(serve)
    serve.set_defaults(handler=_serve, parser=serve)

    generate = commands.add_parser("generate", help="generate text offline and print it", allow_abbrev=False)
    _add_engine_flags(generate)
    generate.add_argument("--prompt", action="append", help="a prompt (repeat for several); default: a demo prompt")
    generate.add_argument("--chat", action="store_true",
                          help="send each prompt as a user message through the chat template")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--request-seed", type=int, default=None, help="seed of every request's sampling")
    generate.add_argument("--profile-dir", type=Path, help="record a JAX profiler trace of the generation here")
    _add_process_group_flags(generate)
    generate.set_defaults(handler=_generate, parser=generate)

    batch = commands.add_parser("run-batch", help="run an OpenAI batch-style JSONL file of requests",
                                   allow_abbrev=False)
    _add_engine_flags(batch)
    batch.add_argument("-i", "--input-file", type=Path, required=True, help="JSONL: one request per line")
    batch.add_argument("-o", "--output-file", type=Path, required=True, help="JSONL: one result per line")
    batch.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="the model names lines may give; results carry the first (default: the folder's name)")
    batch.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=[],
                       help="LoRA adapters lines may name as their model, each name=path or JSON {\"name\": ..., "
                       "\"path\": ...} (needs --enable-lora)")
    batch.add_argument("--profile-dir", type=Path, help="record a JAX profiler trace of the run here")
    _add_process_group_flags(batch)
    batch.set_defaults(handler=_run_batch, parser=batch)

    convert = commands.add_parser("convert", help="convert an HF safetensors folder into an Orbax checkpoint",
                                     allow_abbrev=False)
    convert.add_argument("hf_dir", type=Path)
    convert.add_argument("out_dir", type=Path)
    convert.set_defaults(handler=_convert, parser=convert)
    _add_compile_command(commands)
    return parser


def _add_engine_flags(parser: argparse.ArgumentParser, compiled: bool = True) -> None:
    """--config and one flag per EngineConfig setting marked as a flag; None means 'keep the preset's value'.
    `compiled`: --compiled too (compiled_dir), for the commands that start an engine."""
    # A group of their own: `--help` and the generated flags page (tools/docs_pages.py) list them apart.
    group = parser.add_argument_group(ENGINE_GROUP, "what to load, the step limits, the KV cache and the fast paths; "
                                      "each is also a preset key and an LLM(...) keyword")
    group.add_argument("--config", type=Path, help="YAML preset from configs/")
    for field in flag_fields():
        flag = "--" + field.name.replace("_", "-")
        # argparse formats help with %: a literal one ("4% of max_model_len") must be doubled
        text = field.metadata["help"].replace("%", "%%")
        if flag_type(field.name) is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            group.add_argument(flag, type=flag_type(field.name), help=text)
    if compiled:
        group.add_argument("--compiled", dest="compiled_dir", metavar="DIR",
                           help="a store of compiled step programs (`jaxserve compile --out DIR`, or any earlier "
                           "start): those kept there load without tracing, lowering or compiling, the others are "
                           "compiled and added (default: programs/ in the compilation cache folder; none: off)")


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    # A light module: no JAX, no web framework.
    from jaxserve.server.config import METRICS_PREFIXES, REASONING_PARSERS, TOOL_CALL_PARSERS

    parser = parser.add_argument_group(SERVER_GROUP, "HTTP, API keys and quotas, limits, shutdown, LoRA and tools")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000; 0 picks a free one)")
    parser.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
                        help="require `Authorization: Bearer KEY` on every route but /health, /version and "
                        "/metrics (default: $JAXSERVE_API_KEY)")
    parser.add_argument("--api-keys-file", type=Path, metavar="PATH",
                        help="YAML or JSON list of named keys, each with optional requests_per_minute, "
                        "tokens_per_minute and max_concurrent_requests (over a limit: 429 with Retry-After); "
                        "reread on SIGHUP; excludes --api-key")
    parser.add_argument("--metrics-need-key", action="store_true", help="/metrics asks for the API key too")
    parser.add_argument("--metrics-prefix", choices=METRICS_PREFIXES, default="jaxserve",
                        help="name the /metrics series jaxserve:*, or vllm:* with vLLM's names, labels and buckets "
                        "for vLLM's dashboards, alerts and endpoint pickers (default: jaxserve)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the model ids clients may use; answers carry the first (default: the folder's name)")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="requests queued beyond the running batch; more are answered 503 at once (default: 256)")
    parser.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024,
                        help="larger request bodies are refused with 413 (default: 8 MiB)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish after SIGTERM (default: 30)")
    parser.add_argument("--stream-timeout", type=float, default=60.0,
                        help="seconds a client may leave a response unread (its send blocked) before it is dropped "
                        "and its request aborted (default: 60)")
    parser.add_argument("--profile-dir", type=Path, help="enables /start_profile and /stop_profile, traces go here")
    parser.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=[],
                        help="LoRA adapters served from the start, each name=path or JSON {\"name\": ..., "
                        "\"path\": ...}; requests name one as their model (needs --enable-lora)")
    # vLLM needs these two for tool_choice "auto"; here it is always on, with Llama 3's JSON calls by default.
    # Taken so that a vLLM command line runs unchanged; a parser this server does not have is an error.
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's switch for tool_choice auto, which is always on here")
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="llama3_json",
                        help="how tool calls are written in answers, as vLLM names the forms: llama3_json (Llama 3's "
                        "JSON, the default), hermes (Qwen2.5/Qwen3's <tool_call> blocks), mistral ([TOOL_CALLS] and "
                        "a JSON array); forced calls are written in it too")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                        help="how reasoning models write their reasoning, as vLLM names them: qwen3 or deepseek_r1 "
                        "(<think>...</think>); it comes back as reasoning_content (streamed as "
                        "delta.reasoning_content), and output constraints apply after it (default: none)")
    parser.add_argument("--allow-unknown-fields", action="store_true",
                        help="drop request fields this server does not declare instead of answering 400 (for "
                        "clients that send extras); declared but unimplemented fields are still refused")


def _add_process_group_flags(parser: argparse.ArgumentParser) -> None:
    """Multi-host: each flag defaults to its JAXSERVE_* environment variable, which a launcher's pod or job spec can
    set from its own (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX; SLURM_NTASKS, SLURM_PROCID)."""
    env = os.environ
    parser = parser.add_argument_group(PROCESS_GROUP_GROUP, "one model over the devices of several processes")
    parser.add_argument("--coordinator", default=env.get("JAXSERVE_COORDINATOR"), metavar="HOST:PORT",
                        help="process 0's address for jax.distributed; runs one model over the devices of "
                        "--num-processes processes (default: $JAXSERVE_COORDINATOR; none: one process)")
    parser.add_argument("--num-processes", type=int, default=_int_env("JAXSERVE_NUM_PROCESSES"),
                        help="processes in the group (default: $JAXSERVE_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int, default=_int_env("JAXSERVE_PROCESS_ID"),
                        help="this process's rank; 0 serves HTTP and schedules (default: $JAXSERVE_PROCESS_ID)")
    parser.add_argument("--heartbeat-timeout", type=int, default=10,
                        help="seconds a silent process may take before the whole group ends (default: 10)")


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _process_group(args: argparse.Namespace):
    """The group these flags describe; None for a single process."""
    from jaxserve.parallel.process_group import ProcessGroup

    flags = (args.coordinator, args.num_processes, args.process_id)
    if all(flag is None for flag in flags):
        return None
    if any(flag is None for flag in flags):
        raise JaxserveError("--coordinator, --num-processes and --process-id go together (or their JAXSERVE_* "
                            "environment variables)")
    return ProcessGroup(coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id,
                        heartbeat_timeout_s=args.heartbeat_timeout)


def _join_process_group(args: argparse.Namespace) -> None:
    """Joins the group the flags describe, if any: before the model loads, since from then on jax.devices() lists
    the devices of every process."""
    from jaxserve.parallel.process_group import initialize_process_group

    group = _process_group(args)
    if group is not None:
        initialize_process_group(group)


def _followed(llm) -> bool:
    """True once a process other than 0 of a group has run process 0's steps to their end; False on process 0."""
    if not llm.is_follower:
        return False
    llm.follow_leader()
    return True


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    config = load_config(args.config, {name: getattr(args, name) for name in FIELD_NAMES if hasattr(args, name)})
    claim_device_memory(config.gpu_memory_utilization)  # before anything imports JAX
    return config


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # JAX probes for a TPU on every start and logs the failure at INFO: noise on every GPU and CPU host.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    from jaxserve.server.api_keys_file import load_api_keys_file
    from jaxserve.server.config import ServerConfig, parse_lora_module

    if args.model_path is not None:
        if args.model is not None and args.model != args.model_path:
            raise JaxserveError(f"two models given: {args.model_path} and --model {args.model}")
        args.model = args.model_path
    engine_config = _engine_config(args)
    config = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key or None, api_keys_file=args.api_keys_file,
        served_model_names=tuple(args.served_model_name or [_model_name(engine_config.model)]),
        max_waiting_requests=args.max_waiting_requests, max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout, stream_timeout_s=args.stream_timeout,
        profile_dir=args.profile_dir, allow_unknown_fields=args.allow_unknown_fields,
        metrics_need_key=args.metrics_need_key, metrics_prefix=args.metrics_prefix,
        lora_modules=tuple(parse_lora_module(entry) for entry in args.lora_modules),
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    if config.lora_modules and not engine_config.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    if config.api_keys_file is not None:
        load_api_keys_file(config.api_keys_file)  # a bad file fails now, not after the model has loaded
    log.info("starting: %s; loading the model, then compiling its step programs",
             engine_config.model or "the built-in model")
    # Imported after that first line: the server's imports (JAX, the web framework) take a second or two.
    from jaxserve.server.serve import serve

    _join_process_group(args)
    return serve(engine_config, config)


def _model_name(model: str | None) -> str:
    return Path(model).name if model else "jaxserve-builtin"


def _generate(args: argparse.Namespace) -> int:
    from jaxserve.entrypoints.llm import LLM  # JAX loads only for commands that need it
    from jaxserve.sampling_params import SamplingParams

    config = _engine_config(args)
    # Cheap checks first: a typo must not wait for weights to load and programs to compile.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.request_seed)
    _join_process_group(args)
    llm = LLM.from_config(config)
    if _followed(llm):  # process 0 generates and prints
        return 0
    prompts = args.prompt or [DEMO_PROMPT]
    with _profiling(args.profile_dir):
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.release_followers()
    if config.model is None:
        print("(built-in tiny random model: its output is noise; pass --model DIR for real weights)", file=sys.stderr)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        print(f"{prompt!r} -> {completion.text!r}  [{len(completion.token_ids)} tokens, {completion.finish_reason}]")
    return 0


def _run_batch(args: argparse.Namespace) -> int:
    from jaxserve.entrypoints.batch_runner import BatchModels, run_batch
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.lora_request import LoRARequest
    from jaxserve.server.config import parse_lora_module

    config = _engine_config(args)
    if not args.input_file.is_file():
        raise JaxserveError(f"batch input file not found: {args.input_file}")
    lora_modules = [parse_lora_module(entry) for entry in args.lora_modules]
    if lora_modules and not config.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    _join_process_group(args)
    llm = LLM.from_config(config)
    if _followed(llm):  # process 0 reads the input and writes the results
        return 0
    adapters = {name: LoRARequest(name, lora_id, path) for lora_id, (name, path) in enumerate(lora_modules, 1)}
    for adapter in adapters.values():  # read now: a bad folder stops the run before any line does
        llm.engine.add_lora(adapter)
    models = BatchModels(tuple(args.served_model_name or [_model_name(config.model)]), adapters)
    with _profiling(args.profile_dir):
        succeeded, failed = run_batch(llm, args.input_file, args.output_file, models)
    llm.release_followers()
    print(f"wrote {succeeded + failed} results to {args.output_file} ({succeeded} succeeded, {failed} failed)")
    return 0


@contextlib.contextmanager
def _profiling(profile_dir: Path | None):
    """A JAX profiler trace (TensorBoard / Perfetto) of the block, when a folder is given."""
    if profile_dir is None:
        yield
        return
    import jax

    with jax.profiler.trace(str(profile_dir)):
        yield
    print(f"profiler trace written to {profile_dir}", file=sys.stderr)


def _convert(args: argparse.Namespace) -> int:
    from jaxserve.checkpoint import convert_hf_to_orbax

    convert_hf_to_orbax(args.hf_dir, args.out_dir)
    print(f"wrote Orbax checkpoint to {args.out_dir}")
    return 0


def _add_compile_command(commands) -> None:
    compile_ = commands.add_parser(
        "compile", allow_abbrev=False,
        help="build a preset's GPU step programs for a GPU target without a GPU or weights, and audit them or keep "
        "them in a program store (--out) for `serve --compiled`")
    _add_engine_flags(compile_, compiled=False)
    compile_.add_argument("--target", required=True,
                          help="h100, h200 (configs/gpu-targets/NAME.pbtxt), a target description's path, or cpu "
                          "(this host's CPU; with --out only)")
    compile_.add_argument("--out", type=Path, metavar="DIR",
                          help="write every program a start compiles into this program store instead of auditing "
                          "them; `jaxserve serve --compiled DIR` (same preset and flags, same jax, jaxlib, CUDA "
                          "plugin and XLA_FLAGS) then starts without compiling")
    compile_.add_argument("--model-shape", help="the model whose programs are built: llama-3.1-8b or llama-3.1-70b "
                          "(default: the one the preset is named after; or --model DIR's config.json)")
    compile_.add_argument("--audit", type=Path, metavar="OUT.json", help="write every program's findings here")
    compile_.add_argument("--dump-hlo", type=Path, metavar="DIR",
                          help="write each program's optimized HLO (and XLA's dumps, thunks among them) here")
    compile_.add_argument("--context-len", type=int, default=1024,
                          help="each sequence's context that the roofline's KV reads assume (default: 1024)")
    compile_.add_argument("--programs", metavar="REGEX",
                          help="only the programs whose names match, e.g. 'decode S=(1|64)$|sampler'")
    compile_.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE",
                          help="an XLA compiler option for every program (repeatable), e.g. "
                          "xla_gpu_enable_triton_gemm=false")
    compile_.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                          help="programs compiled at once (default: one per core)")
    compile_.add_argument("--on-device", action="store_true",
                          help="on a GPU host: build for its own GPUs (XLA autotunes there), to compare with the "
                          "target's build")
    compile_.set_defaults(handler=_compile, parser=compile_)


def _compile(args: argparse.Namespace) -> int:
    from jaxserve.gpu_programs.target import prepare_compile_environment

    if args.out is not None or args.target == "cpu":
        return _compile_store(args)
    if not args.on_device:
        prepare_compile_environment()  # before JAX starts: the CUDA plugin registers beside the CPU backend
    from jaxserve.gpu_programs.command import CompileRequest, parse_compiler_options, run_compile

    config = load_config(args.config, {name: getattr(args, name) for name in FIELD_NAMES if hasattr(args, name)})
    run_compile(CompileRequest(config=config, preset=args.config, target=args.target, model_shape=args.model_shape,
                               audit_path=args.audit, dump_dir=args.dump_hlo, context_tokens=args.context_len,
                               program_filter=args.programs,
                               compiler_options=parse_compiler_options(args.xla_option), jobs=args.jobs,
                               on_device=args.on_device))
    return 0


def _compile_store(args: argparse.Namespace) -> int:
    """`jaxserve compile --out DIR`: the programs start-up compiles, built and written to a program store."""
    from jaxserve.gpu_programs.target import prepare_compile_environment

    if args.out is None:
        raise ConfigError("--target cpu builds a program store: give --out DIR (the audit reads GPU programs)")
    refused = [flag for flag, given in (("--audit", args.audit), ("--dump-hlo", args.dump_hlo),
                                        ("--programs", args.programs), ("--xla-option", args.xla_option),
                                        ("--on-device", args.on_device)) if given]
    if refused:
        raise ConfigError(f"--out stores every program as a start compiles it: {', '.join(refused)} audit or change "
                          "programs (run the audit as its own command)")
    if args.target != "cpu":
        prepare_compile_environment()  # before JAX starts: the CUDA plugin registers beside the CPU backend
    from jaxserve.gpu_programs.store_fill import fill_store

    config = load_config(args.config, {name: getattr(args, name) for name in FIELD_NAMES if hasattr(args, name)})
    fill = fill_store(config, args.config, args.target, args.out, args.model_shape)
    return 1 if fill.missing else 0  # a store a start would still compile in is not what was asked for


if __name__ == "__main__":
    sys.exit(main())
