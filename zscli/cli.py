"""The ``zeroservice`` command."""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
from pathlib import Path

from api.settings import SettingsError
from zscli.client import ApiError
from zscli.plan_cli import add_plan_parser


def _demo(args: argparse.Namespace) -> int:
    from zeroservice.demo import DemoSpec, format_report, train
    from zeroservice.launch import run_local

    if args.json:  # before training: a destination that cannot be written fails at once
        target = Path(args.json)
        if target.is_dir() or not target.parent.is_dir():
            what = "a directory" if target.is_dir() else "in no existing directory"
            print(f"zeroservice demo: --json {args.json}: {what}", file=sys.stderr)
            return 2

    spec = DemoSpec(
        stage=args.stage,
        precision=args.precision,
        steps=args.steps,
        batch=args.batch,
        accum=args.accum,
    )
    print(
        f"training the reference GPT on {args.world} local ranks (gloo), "
        f"ZeRO stage {args.stage}, {args.precision}",
        flush=True,
    )
    results = run_local(train, args.world, spec, threads=args.threads)
    print(format_report(results))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(results[0], indent=2))
        except OSError as exc:
            print(f"zeroservice demo: --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        print(f"\nwrote {args.json}")
    return 0


def _checkpoint_inspect(args: argparse.Namespace) -> int:
    from zeroservice.checkpoint import CheckpointError, describe

    try:
        print(describe(args.dir, verify=args.verify))
    except (CheckpointError, OSError) as exc:
        print(f"zeroservice: {exc}", file=sys.stderr)
        return 1
    return 0


def _checkpoint_export(args: argparse.Namespace) -> int:
    from zeroservice.checkpoint import CheckpointError, export_checkpoint

    fmt = args.format or ("pt" if args.out.endswith((".pt", ".pth")) else "safetensors")
    try:
        out = export_checkpoint(args.dir, args.out, fmt, args.prefix)
    except (CheckpointError, OSError) as exc:
        print(f"zeroservice: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({fmt}, {Path(out).stat().st_size:,} bytes)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeroservice", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the reference GPT on local ranks and report")
    demo.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3)
    demo.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    demo.add_argument("--world", type=int, default=2, help="local ranks (processes)")
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    demo.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    demo.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    demo.add_argument("--json", help="also write rank 0's results to this file")
    demo.set_defaults(func=_demo)

    ckpt = sub.add_parser("checkpoint", help="inspect or export a sharded checkpoint")
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint_command", required=True)
    inspect = ckpt_sub.add_parser("inspect", help="print a checkpoint's manifest")
    inspect.add_argument("dir", help="a checkpoint directory (step-N)")
    inspect.add_argument("--verify", action="store_true", help="read every byte, check sums")
    inspect.set_defaults(func=_checkpoint_inspect)
    export = ckpt_sub.add_parser("export", help="write the full fp32 weights as one file")
    export.add_argument("dir", help="a checkpoint directory (step-N)")
    export.add_argument("out", help="output file (.safetensors, or .pt)")
    export.add_argument("--format", choices=("safetensors", "pt"), help="default: from OUT")
    export.add_argument(
        "--prefix",
        help="export only the names under this prefix, without it ('' keeps every name as "
        "saved); default: the prefix the checkpoint records (a transformers job's 'model.')",
    )
    export.set_defaults(func=_checkpoint_export)
    add_plan_parser(sub)

    from .service_cli import add_service_parsers

    add_service_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("world", "steps", "batch", "accum", "threads"):
        if getattr(args, name, 1) < 1:
            print(f"zeroservice: --{name} must be >= 1", file=sys.stderr)
            return 2
    try:
        return int(args.func(args))
    except SettingsError as exc:  # a ZEROSERVICE_* variable of the wrong kind
        print(f"zeroservice: {exc}", file=sys.stderr)
        return 2
    except ApiError as exc:  # one raised outside a command's own handling
        print(f"zeroservice: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        if not _reader_gone():
            raise  # another pipe or socket: an error to show
        # The reader went away (`zeroservice list | head -1`): the rest of the output has
        # nowhere to go, so it ends quietly, with the status of a process ended by
        # SIGPIPE. Output still buffered goes to /dev/null, or its flush at exit would
        # raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _reader_gone() -> bool:
    """Whether standard output is a pipe that nobody reads any more (poll says POLLERR)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
    except (AttributeError, OSError, ValueError):  # not a file descriptor (captured)
        return False
    return any(events & select.POLLERR for _, events in poller.poll(0))


if __name__ == "__main__":
    sys.exit(main())
