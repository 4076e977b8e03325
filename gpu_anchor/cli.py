"""The ``gpu-anchor`` command.

    gpu-anchor daemon --device cuda:0 [--socket PATH] [--detach]
    gpu-anchor status [--json] [--all] [--socket PATH | --device D]
    gpu-anchor drop NAMESPACE [--device D]
    gpu-anchor stop [--device D]
    gpu-anchor run [options] -- COMMAND...       supervise a job on this node
    gpu-anchor torchrun TORCHRUN-ARGS...         torch elastic with this node's daemons
    gpu-anchor serve MODEL_DIR | --random-weights CONFIG

Subcommands that only talk to daemons never import torch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from gpu_anchor import errors
from gpu_anchor.client import control
from gpu_anchor.client.channel import Channel, resolve_socket
from gpu_anchor.paths import default_socket, normalize_device, socket_dir


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _targets(args) -> dict[str, str | None]:
    if getattr(args, "socket", None):
        return {normalize_device(args.device or "cpu"): args.socket}
    if getattr(args, "device", None):
        return {normalize_device(args.device): None}
    return control.discover()


def cmd_daemon(args) -> int:
    device = normalize_device(args.device)
    path = args.socket or default_socket(device)
    if args.detach:
        hello = control.ping(device, path)
        if hello is not None:
            print(f"a daemon for {device} already answers at {path} (pid {hello['pid']})")
            return 0
        proc = control.start(device, path)
        print(f"gpu-anchor daemon for {device} started at {path} (pid {proc.pid})")
        return 0
    from gpu_anchor.daemon.__main__ import main as daemon_main
    return daemon_main(["--device", device, "--socket", path, "--log-level", args.log_level])


def _status_targets(args) -> dict[str, str | None]:
    """``--socket``, then ``GPU_ANCHOR_SOCKET``, then the per-user directory (every daemon there,
    or ``--device``'s)."""
    path = args.socket or os.environ.get("GPU_ANCHOR_SOCKET")
    if path:  # the device is whatever the daemon there serves: its status says
        return {normalize_device(args.device or "cpu"): path}
    return _targets(args)


def _status_of(device: str, path: str | None) -> dict:
    try:
        ch = Channel(device, path, timeout=5.0)
    except errors.AnchorError as e:
        why = "no daemon answers" if isinstance(e, errors.DaemonUnavailable) else str(e).splitlines()[0]
        return {"device": device, "socket": resolve_socket(device, path), "error": why}
    try:
        st = ch.request({"op": "status"})[0]
        st.pop("ok", None), st.pop("nfds", None)
        st["socket"] = ch.path
        for name, ns in st.get("namespaces", {}).items():
            ns["training"] = _training_of(ch, name, ns.get("journal_keys", []))
        return st
    finally:
        ch.close()


def _training_of(ch: Channel, namespace: str, keys: list) -> dict:
    """Where each training protocol in ``namespace`` stands (a prefix with ``state`` and
    ``meta`` keys: ``AnchoredOptimizer``'s), as its next worker would resume."""
    from gpu_anchor import protocol as wire
    from gpu_anchor.train.protocol import describe      # torch-free
    out = {}
    for prefix in sorted({k[: -len("/state")] for k in keys if k.endswith("/state")} &
                         {k[: -len("/meta")] for k in keys if k.endswith("/meta")}):
        reply, blob, _ = ch.request({"op": "journal_get", "prefix": prefix + "/", "namespace": namespace})
        out[prefix] = describe(wire.unpack_blobs(reply["values"], blob), prefix)
    return out


def _training_line(prefix: str, t: dict) -> str:
    if not t.get("consistent"):
        return f"    training ({prefix!r}): inconsistent state ({t.get('error', 'a step in flight without its redo log')})"
    if t.get("in_flight_step") is None:
        return f"    training ({prefix!r}): {t['completed_steps']} step(s) completed"
    return (f"    training ({prefix!r}): {t['completed_steps'] - 1} step(s) completed and one in flight (chunk "
            f"{t['cursor']} of {t['chunks']}), which the next worker finishes from its redo log")


def cmd_status(args) -> int:
    from gpu_anchor.launch import jobstate
    report = [_status_of(d, p) for d, p in _status_targets(args).items()]
    every_job = jobstate.load_all()   # supervisors keep them in the per-user directory
    jobs = every_job if args.all else [j for j in every_job if jobstate.is_live(j)]
    hidden = len(every_job) - len(jobs)
    if args.json:
        json.dump({"socket_dir": socket_dir(), "daemons": report, "jobs": jobs, "jobs_not_shown": hidden},
                  sys.stdout, indent=2)
        print()
        return 0
    if jobs:
        print(jobstate.format_jobs(jobs))
    if hidden:
        print(f"({hidden} finished or abandoned job(s) not shown: --all)")
    if not report:
        print(f"no gpu-anchor daemons in {socket_dir()} (start one: gpu-anchor daemon --device cuda:0 --detach)")
        return 0
    for st in report:
        if "error" in st:
            print(f"{st['socket']}: {st['error']}")
            continue
        be = st["backend"]
        extra = f", {be['name']} {be['uuid']}" if "uuid" in be else ""
        print(f"{st['device']}: pid {st['pid']}, up {st['uptime_s']} s, {st['connections']} connection(s){extra}")
        print(f"  memory: {_human(st['object_bytes'])} in objects, {_human(st['reserved_bytes'])} reserved "
              f"in {st['segments']} segment(s)")
        for name, ns in sorted(st["namespaces"].items()):
            print(f"  namespace {name!r}: {len(ns['objects'])} object(s), {_human(ns['object_bytes'])}; "
                  f"journal v{ns['journal_version']}, {len(ns['journal_keys'])} key(s)")
            objs = sorted(ns["objects"], key=lambda o: -o["nbytes"])
            for o in objs[: args.limit]:
                print(f"    {o['name']:<60} {o['dtype']:>9} {str(tuple(o['shape'])):<22} {_human(o['nbytes'])}")
            if len(objs) > args.limit:
                print(f"    ... {len(objs) - args.limit} more (--limit N)")
            for prefix, t in ns.get("training", {}).items():
                print(_training_line(prefix, t))
            if ns["journal_keys"]:
                keys = ns["journal_keys"]
                print(f"    journal keys: {', '.join(keys[:10])}{' ...' if len(keys) > 10 else ''}")
    return 0


def cmd_drop(args) -> int:
    total = 0
    for device, path in _targets(args).items():
        try:
            ch = Channel(device, path, timeout=10.0)
        except errors.AnchorError as e:
            print(f"{device}: skipped ({str(e).splitlines()[0]})", file=sys.stderr)
            continue
        try:
            names = ch.request({"op": "status"})[0]["namespaces"]
            # the host daemon keeps each rank's state under NAMESPACE/rankN
            for ns in [n for n in names if n == args.namespace or n.startswith(args.namespace + "/")]:
                freed = ch.request({"op": "drop", "namespace": ns})[0]["freed"]
                total += freed
                print(f"{device}: dropped namespace {ns!r} ({freed} object(s))")
        finally:
            ch.close()
    if total == 0:
        print(f"nothing anchored under {args.namespace!r}")
    return 0


def cmd_stop(args) -> int:
    for device, path in _targets(args).items():
        print(f"{device}: {'stopped' if control.stop(device, path) else 'no daemon answering'}")
    return 0


def cmd_migrate(args) -> int:
    """Ask a running ``gpu-anchor serve`` to move its engine; prints the cut-over report."""
    import urllib.error
    import urllib.request
    try:
        device = "cpu" if args.to == "cpu" else normalize_device(args.to)
    except ValueError as e:
        print(f"gpu-anchor migrate: {e}", file=sys.stderr)
        return 2
    url = args.url.rstrip("/")
    try:
        urllib.request.urlopen(url + "/health", timeout=10).close()
    except urllib.error.HTTPError:
        pass                                  # 503: no engine right now; the server answers that below
    except (urllib.error.URLError, OSError) as e:
        print(f"gpu-anchor migrate: cannot reach {url}: {e}", file=sys.stderr)
        return 1
    path = args.socket or default_socket(device)
    if control.ping(device, path) is None:   # the destination daemon must outlive the engine: start it here
        try:
            control.start(device, path)
        except RuntimeError as e:
            print(f"gpu-anchor migrate: cannot start the daemon for {device}: {e}", file=sys.stderr)
            return 1
    headers = {"Content-Type": "application/json"}
    key = args.api_key or os.environ.get("VLLM_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + "/admin/migrate", method="POST",
                                 data=json.dumps({"device": device, "socket": path}).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            report = json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")
        print(f"gpu-anchor migrate: the server refused ({e.code}): {body}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as e:
        print(f"gpu-anchor migrate: no answer from {url}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu-anchor", description="Keep PyTorch jobs' GPU state alive across crashes.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("daemon", help="run the memory daemon of one device")
    d.add_argument("--device", required=True, help="cpu or cuda:N")
    d.add_argument("--socket", help="socket path (default: per-user directory)")
    d.add_argument("--detach", action="store_true", help="start in the background and return once it answers")
    d.add_argument("--log-level", default="INFO")
    d.set_defaults(func=cmd_daemon)

    s = sub.add_parser("status", help="devices, namespaces, objects, memory and journal keys; live jobs",
                       description="Asks the daemon at --socket, else at $GPU_ANCHOR_SOCKET, else every daemon "
                                   "in the per-user socket directory (--device: that device's).")
    s.add_argument("--json", action="store_true")
    s.add_argument("--all", action="store_true", help="also list finished jobs and jobs whose supervisor is gone")
    s.add_argument("--device")
    s.add_argument("--socket")
    s.add_argument("--limit", type=int, default=20, help="objects listed per namespace")
    s.set_defaults(func=cmd_status)

    dr = sub.add_parser("drop", help="free a job's anchored state on purpose")
    dr.add_argument("namespace")
    dr.add_argument("--device")
    dr.add_argument("--socket")
    dr.set_defaults(func=cmd_drop)

    st = sub.add_parser("stop", help="shut daemons down (their memory is released)")
    st.add_argument("--device")
    st.add_argument("--socket")
    st.set_defaults(func=cmd_stop)

    mg = sub.add_parser("migrate", help="move a running gpu-anchor serve engine to another GPU or daemon",
                        description="Pre-copies the engine's weights and KV cache while it serves, cuts over "
                                    "between two steps and resumes every in-flight request on the destination "
                                    "(state streams in on demand); client streams stay open.")
    mg.add_argument("--to", required=True, help="destination device: cuda:N or cpu")
    mg.add_argument("--socket", help="destination daemon socket (default: the device's standard one; another "
                                     "path = another host daemon)")
    mg.add_argument("--url", default="http://127.0.0.1:8000", help="the server's HTTP address")
    mg.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the cut-over")
    mg.add_argument("--api-key", default=None, help="the server's API key (default: $VLLM_API_KEY, if set)")
    mg.set_defaults(func=cmd_migrate)

    from gpu_anchor.launch.cli import add_run_parser, add_torchrun_parser
    add_run_parser(sub)
    add_torchrun_parser(sub)
    from gpu_anchor.launch.serve import add_parser as add_serve_parser  # torch loads only when serve runs
    add_serve_parser(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except errors.AnchorError as e:
        print(f"gpu-anchor: {e}", file=sys.stderr)
        return 2


def entry() -> None:
    """The ``gpu-anchor`` command: ``main`` through ``runtime.exit_path`` (non-daemon threads,
    atexit, stdio flush, then ``os._exit``).  A supervisor that imported torch and transformers
    (``serve``, ``torchrun``) has shut down what it started by then; the interpreter's teardown
    of those modules would only delay its exit by ~1 s."""
    from gpu_anchor import runtime
    runtime.exit_path(lambda: sys.exit(main()))


if __name__ == "__main__":
    entry()
