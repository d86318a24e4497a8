"""The ``pdserve`` command.

    pdserve up [--detach] [--prefill N --decode N --tokenizer N --postfilter N]
    pdserve down
    pdserve status
    pdserve kv ledger
    pdserve convert
    pdserve settings
    pdserve bench {pipeline,bus,engine,modes,load,gpu} (from loadtest/, see COMMANDS_GROUP)
    pdserve chaos                                    (from loadtest/)
    pdserve profile | plan | simulate                (from sim/)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from shared.config import Settings, SettingsError


def _settings(args) -> Settings:
    overrides = {}
    if getattr(args, "port", None):
        overrides["gateway_port"] = args.port
    if getattr(args, "kv_store", None):
        overrides["kv_store"] = args.kv_store
    try:
        return Settings.from_env(**overrides)
    except SettingsError as exc:
        raise SystemExit(f"pdserve: {exc}") from None


def _state_dir(args, settings: Settings) -> Path:
    """``--state-dir``, else ``$XDG_STATE_HOME/pdserve/<namespace>`` (absolute, so ``down``
    finds a deployment from any folder)."""
    if args.state_dir:
        return Path(args.state_dir).expanduser().resolve()
    base = Path(os.environ.get("XDG_STATE_HOME", "~/.local/state")).expanduser()
    return (base / "pdserve" / settings.namespace).resolve()


def _me() -> str:
    """How to call this command again (``.venv/bin/pdserve`` when that is how it was called)."""
    argv0 = Path(sys.argv[0])
    if argv0.name != "pdserve" or shutil.which("pdserve") == str(argv0.resolve()):
        return "pdserve"
    try:
        return str(argv0.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(argv0.resolve())


def cmd_up(args) -> int:
    from services import launcher

    settings = _settings(args)
    replicas = {"tokenizer": args.tokenizer, "prefill": args.prefill, "decode": args.decode,
                "postfilter": args.postfilter, "gateway": 1}
    state_dir = _state_dir(args, settings)

    affinity = launcher.pin_model_workers(replicas) if args.pin else None

    def start():
        return launcher.up(settings, replicas, state_dir, args.ready_timeout, affinity=affinity,
                           nats_nodes=args.nats_cluster)

    if args.detach:
        print("pdserve: starting in the background ...", flush=True)
        url = launcher.detach(start, state_dir, args.ready_timeout)
        print(f"pdserve is ready at {url}  (OpenAI API: {url}/v1, model '{_model_name(settings)}')", flush=True)
        print(f"logs: {state_dir / 'logs'}", flush=True)
        ns = f"PD_NAMESPACE={settings.namespace} " if os.environ.get("PD_NAMESPACE") else ""
        print(f"stop it with: {ns}{_me()} down", flush=True)
        return 0
    dep = start()
    print(f"pdserve is ready at {dep.url}  (OpenAI API: {dep.url}/v1, model '{_model_name(settings)}')", flush=True)
    print(f"logs: {state_dir / 'logs'}", flush=True)
    print("Ctrl-C stops it; services that die are restarted.", flush=True)
    return launcher.run_foreground(dep)


def _model_name(settings: Settings) -> str:
    from shared.model_files import served_model_name

    return served_model_name(settings)


def cmd_down(args) -> int:
    from services import launcher

    state_dir = _state_dir(args, _settings(args))
    if launcher.down(state_dir):
        print("pdserve: stopped", flush=True)
        return 0
    print(f"pdserve: nothing to stop: no running deployment recorded in {state_dir} "
          "(give --state-dir, or PD_NAMESPACE, as used with 'up')", flush=True)
    return 0  # idempotent, like `docker compose down`: scripts and `make down` may stop twice


def cmd_status(args) -> int:
    from shared.errors import ServiceUnavailable
    from shared.observe import collect_heartbeats

    settings = _settings(args)
    try:
        seen = collect_heartbeats(settings)
    except ServiceUnavailable as exc:
        print(f"pdserve: {exc} (is it running? PD_NATS_URL={settings.nats_url})", file=sys.stderr)
        return 1
    if not seen:
        print("no pdserve workers are sending heartbeats")
        return 1
    rows = sorted(seen.values(), key=lambda h: (h.stage, h.instance_id))
    w_stage = max([5] + [len(h.stage) for h in rows]) + 1
    w_inst = max([8] + [len(h.instance_id) for h in rows]) + 1
    print(f"{'stage':<{w_stage}} {'instance':<{w_inst}} {'ready':<6} {'running':>7} {'metrics port':>12}")
    for hb in rows:
        print(f"{hb.stage:<{w_stage}} {hb.instance_id:<{w_inst}} {str(hb.ready):<6} {hb.num_running:>7} "
              f"{hb.metrics_port:>12}")
    return 0


def cmd_kv(args) -> int:
    """``pdserve kv ledger``: the staged KV handles recorded in the store's ledger."""
    from shared.errors import KVTransferError
    from shared.kv import open_store
    from shared.kv.ledger import ledger_for

    settings = _settings(args)
    try:
        store = open_store(settings)
        entries = ledger_for(store).entries()
    except (KVTransferError, OSError) as exc:
        print(f"pdserve: cannot read the KV ledger ({settings.kv_store}): {exc}", file=sys.stderr)
        return 1
    now = time.time()
    print(f"{len(entries)} staged KV handle(s) in the {settings.kv_store} ledger of namespace {settings.namespace!r}, "
          f"{sum(e.bytes for e in entries)} request-scoped bytes")
    if entries:
        w = max(10, *(len(e.request_id) for e in entries)) + 1
        o = max(5, *(len(e.owner) for e in entries)) + 1
        print(f"{'request':<{w}} {'owner':<{o}} {'state':<9} {'handed off':<10} {'bytes':>9} {'block bytes':>11} "
              f"{'lease left s':>12} {'deadline in s':>13}")
        for e in entries:
            print(f"{e.request_id:<{w}} {e.owner:<{o}} {e.state:<9} {str(e.handed_off):<10} {e.bytes:>9} "
                  f"{e.block_bytes:>11} {e.lease_until - now:>12.1f} {e.deadline_at - now:>13.1f}")
    store.close()
    return 0


def cmd_convert(args) -> int:
    from engine.model.loader import ensure_model

    started = time.monotonic()
    print(ensure_model(_settings(args)), f"({time.monotonic() - started:.1f}s)")
    return 0


def cmd_settings(args) -> int:
    if args.markdown:
        print("| variable | default | meaning |")
        print("|---|---|---|")
        for name, default, doc in Settings.table():
            print(f"| `{name}` | `{default}` | {doc} |")
        return 0
    current = _settings(args).to_env()
    width = max(len(n) for n, _, _ in Settings.table())
    print(f"{'variable':<{width}}  {'in effect':<28} default")
    for name, default, _ in Settings.table():
        mark = "" if current[name] == default else "  (set)"
        print(f"{name:<{width}}  {current[name]:<28} {default}{mark}")
    return 0


#: Entry-point group of commands that live outside the product (``pdserve bench``, ``pdserve chaos``
#: from ``loadtest/``): found by name, imported only when run.
COMMANDS_GROUP = "pdserve.commands"


def external_commands() -> dict:
    """``{name: entry point}`` of the commands registered under :data:`COMMANDS_GROUP`; each
    loads to a callable ``fn(argv) -> exit status``."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving over NATS.")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start every service and wait until ready")
    up.add_argument("--detach", action="store_true", help="return once ready; stop with 'pdserve down'")
    for stage in ("tokenizer", "prefill", "decode", "postfilter"):
        up.add_argument(f"--{stage}", type=int, default=1, metavar="N", help=f"{stage} replicas (default 1)")
    up.add_argument("--pin", action="store_true", help="pin each prefill/decode replica to its own CPU")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="with no NATS at PD_NATS_URL, start a local N-node cluster (JetStream, replicas 3)")
    up.add_argument("--port", type=int, help="gateway port (default PD_GATEWAY_PORT or 8000)")
    up.add_argument("--kv-store", choices=("shm", "redis"), help="KV store (default PD_KV_STORE or shm)")
    up.add_argument("--state-dir", default=None,
                    help="pids, logs, NATS store (default ~/.local/state/pdserve/<PD_NAMESPACE>)")
    up.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    up.set_defaults(fn=cmd_up)

    down = sub.add_parser("down", help="stop a deployment started with --detach")
    down.add_argument("--state-dir", default=None, help="as given to 'up'")
    down.set_defaults(fn=cmd_down)

    st = sub.add_parser("status", help="list live workers from their heartbeats")
    st.set_defaults(fn=cmd_status)

    kv = sub.add_parser("kv", help="the KV store's ledger of staged handles: pdserve kv ledger")
    kv.add_argument("what", choices=("ledger",), help="ledger: every staged handle, its owner, state and lease")
    kv.add_argument("--kv-store", choices=("shm", "redis"), help="KV store (default PD_KV_STORE or shm)")
    kv.set_defaults(fn=cmd_kv)

    conv = sub.add_parser("convert", help="convert the default model once (up does this too)")
    conv.set_defaults(fn=cmd_convert)

    se = sub.add_parser("settings", help="the PD_* settings in effect (and their defaults)")
    se.add_argument("--markdown", action="store_true", help="the defaults as the README's Markdown table")
    se.set_defaults(fn=cmd_settings)

    helps = {"chaos": "fault-injection suite (killed workers, restarts, disconnects)",
             "bench": "benchmarks that print their figures: pdserve bench NAME --help",
             "profile": "measure the simulator's cost profile on this machine and model",
             "plan": "fewest prefill/decode workers that meet TTFT/ITL SLOs (simulated); --emit k8s",
             "simulate": "replay a trace through a topology in the discrete-event simulator"}
    for name in sorted(external_commands()):
        ext = sub.add_parser(name, help=helps.get(name, f"{name} (from {COMMANDS_GROUP})"), add_help=False)
        ext.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `pdserve settings | head` ends quietly
    argv = sys.argv[1:] if argv is None else list(argv)
    # commands from other packages parse their own options: they get the rest of the line
    external = external_commands()
    if argv[:1] and argv[0] in external:
        return external[argv[0]].load()(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    return args.fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
