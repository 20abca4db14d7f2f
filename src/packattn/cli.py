"""The packattn command: info lists backends, build compiles the CPU kernel, bench benchmarks."""

from __future__ import annotations

import argparse
import platform
import time

import torch

from .dispatch import info


def _info() -> int:
    threads = torch.get_num_threads()
    print(f"packattn on torch {torch.__version__}, Python {platform.python_version()}, {threads} threads")
    width = max(len(b.name) for b in info())
    for b in info():
        state = "available" if b.available else f"unavailable: {b.reason}"
        print(f"  {b.name:<{width}}  {state}")
        if b.details:
            print(f"  {'':<{width}}    {b.details}")
    return 0


def _build(args: argparse.Namespace) -> int:
    from .backends.cpu_kernel import build

    start = time.perf_counter()
    try:
        module = build.load(verbose=args.verbose)
    except RuntimeError as exc:
        print(f"cpu_kernel: {exc}")
        return 1
    products = module.bf16_products()
    units = f"bf16 products {products[0]}" + (f" (also {', '.join(products[1:])})" if products[1:] else "")
    print(f"cpu_kernel: ready in {time.perf_counter() - start:.1f} s ({build.capability()}; {units})")
    print(f"  cached in {build.build_dir()}")
    return 0


def _check_bench_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Every option checked before any work starts (a typo should not cost a run)."""
    from .bench import runner
    from .bench.peers import IMPLEMENTATIONS

    if args.distributed:
        given = ("workloads", "dtypes", "impls", "threads", "device", "backward", "json", "plot")
        ignored = [f"--{name}" for name in given if getattr(args, name) != parser.get_default(name)]
        if ignored:
            parser.error(f"--distributed takes --quick and --world-size only, got {' '.join(ignored)}")
        if args.world_size < 2:
            parser.error(f"--world-size must be at least 2, got {args.world_size}")
        return
    names = [w.name for w in runner.workloads(False)]
    for option, given, known in (
        ("--workloads", args.workloads, names),
        ("--dtypes", args.dtypes, list(runner.DTYPES)),
        ("--impls", args.impls, list(IMPLEMENTATIONS)),
    ):
        unknown = [x for x in (given.split(",") if given else []) if x not in known]
        if unknown:
            parser.error(f"unknown {option} {unknown}; expected some of {known}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    try:
        torch.empty(0, device=args.device)
    except (RuntimeError, AssertionError) as exc:
        parser.error(f"--device {args.device} is not usable here: {str(exc).splitlines()[0]}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'packattn[plot]'")
    for path in filter(None, (args.json, args.plot)):
        try:
            open(path, "a").close()
        except OSError as exc:
            parser.error(f"cannot write {path}: {exc}")


def _bench(args: argparse.Namespace) -> int:
    if args.distributed:
        from .bench import distributed

        return distributed.main(["--world-size", str(args.world_size)] + (["--forward-only"] if args.quick else []))
    from .bench.peers import default_impls
    from .bench.runner import run_suite, write_json, write_plot

    impls = args.impls.split(",") if args.impls else default_impls(args.device)
    if args.quick and not args.impls:
        impls.remove("flex (compiled)")  # compiling takes ~15 s per workload
        print("flex (compiled): left out of --quick (it compiles for each workload); run without --quick")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, meta = run_suite(
        quick=args.quick,
        names=args.workloads.split(",") if args.workloads else None,
        dtypes=args.dtypes.split(","),
        impls=impls,
        min_time=0.2 if args.quick else 1.0,
        device=args.device,
        backward=args.backward,
    )
    if args.json:
        write_json(args.json, rows, meta)
    if args.plot:
        write_plot(args.plot, rows)
    failed = [r for r in rows if r.status.startswith(("WRONG", "FAILED")) and r.impl.startswith("packattn")]
    if failed:
        print(f"packattn bench: {len(failed)} packattn row(s) WRONG or FAILED (see the table)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="packattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="list backends and why any cannot run here")
    c = sub.add_parser("build", help="compile packattn's C++ CPU kernel now (otherwise on first use)")
    c.add_argument("--verbose", action="store_true", help="show the compiler's output")
    b = sub.add_parser("bench", help="check packattn and its peers against the float64 oracle, then time them")
    b.add_argument(
        "--quick",
        action="store_true",
        help="smaller workloads, shorter timing, no compiled flex (with --distributed: forward only)",
    )
    b.add_argument("--workloads", help="comma-separated subset, e.g. W1,W3")
    b.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16 (default fp32,bf16)")
    b.add_argument(
        "--impls",
        help="comma-separated implementations (default: packattn and its peers on --device; the backends "
        "that packattn's dispatch picks from run by name, e.g. 'packattn cpu_kernel')",
    )
    b.add_argument("--threads", type=int, help="torch.set_num_threads before timing")
    b.add_argument("--device", default="cpu", help="device type to run on, e.g. cuda (default cpu)")
    b.add_argument(
        "--backward", action="store_true", help="time forward + backward (gradients checked against the oracle)"
    )
    b.add_argument("--json", metavar="PATH", help="write the results as JSON")
    b.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    b.add_argument(
        "--distributed",
        action="store_true",
        help="ring, Ulysses and mesh overhead vs one process (spawns gloo processes)",
    )
    b.add_argument("--world-size", type=int, default=2, help="processes for --distributed (default 2)")
    args = parser.parse_args(argv)
    if args.command == "bench":
        _check_bench_arguments(args, b)
    if args.command == "info":
        return _info()
    if args.command == "build":
        return _build(args)
    return _bench(args)
