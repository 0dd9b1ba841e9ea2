"""`tandem status`: a sampler's GET /status, pretty-printed in the terminal with rich.

    tandem status --url http://127.0.0.1:8100            # one snapshot
    tandem status --url http://127.0.0.1:8100 --watch 2  # refresh every 2 s until Ctrl-C
    tandem status --json                                  # the raw JSON, for scripts

The URL defaults to $TANDEM_SAMPLER_URL, else http://127.0.0.1:8100. GET /status needs the
run's token (every sampler route but /health and /metrics does): `--api-token`, default
$TANDEM_API_TOKEN, sent as `Authorization: Bearer <token>`. Exit status: 0 on success, 2 when
the sampler refuses the token (none given, or not the run's: one line says how to pass it), 1
when it cannot be reached or answers another error (the message says which). httpx, rich and
shared.token_guard are imported: no torch, no FastAPI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import httpx
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from shared.token_guard import TOKEN_ENV, bearer_headers

DEFAULT_URL = "http://127.0.0.1:8100"


def fetch(url: str, timeout: float, api_token: str | None = None) -> dict[str, Any]:
    response = httpx.get(url.rstrip("/") + "/status", timeout=timeout, headers=bearer_headers(api_token))
    response.raise_for_status()
    return response.json()


def refused(prog: str, url: str, api_token: str | None) -> str:
    """The one line for a 401: the run's token is missing or is another run's."""
    what = "refuses the token given" if api_token else "needs the run's token"
    return (f"{prog}: the sampler at {url} {what}: pass the run's token with --api-token or {TOKEN_ENV} "
            f"(the one the sampler was started with)")


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min"


def render(status: dict[str, Any], url: str) -> Group:
    """The whole status as rich renderables (one function, so --watch and one-shot agree)."""
    c, steps, queues, versions = status["config"], status["steps"], status["queues"], status["versions"]
    thr, stale = status["throughput"], status["staleness"]
    rewards = status.get("rewards") or {}

    header = Text.assemble(
        ("Tandem sampler ", "bold"), (url, "cyan"),
        f"  env {c['env']} · {c['strategy']} (max_staleness {c['max_staleness']}) · "
        f"{c['prompts_per_step']}×{c['num_generations']} = {c['batch_size']} samples/step · "
        f"up {_duration(status.get('uptime_seconds'))}",
    )

    summary = Table.grid(padding=(0, 3))
    for _ in range(4):
        summary.add_column(justify="left")
    last_eval = rewards.get("last_eval") or {}
    rows = [
        ("next step", _f(steps["next_step"]), "published version", _f(versions["published"])),
        ("last sealed step", _f(steps["last_sealed_step"]), "min served version", _f(versions["min_served"])),
        ("batches ready", _f(queues["batches_ready"]), "in progress", _f(queues["batches_in_progress"])),
        ("in-flight requests", _f(queues["in_flight_requests"]), "retries / errors",
         f"{_f(thr['retries'])} / {_f(thr['errors'])}"),
        ("completions/s", _f(thr.get("recent_completions_per_second", thr["completions_per_second"]), 1),
         "tokens/s", _f(thr.get("recent_tokens_per_second", thr["tokens_per_second"]), 0)),
        ("staleness mean (recent)", _f(stale["recent_mean"]), "staleness histogram",
         " ".join(f"{k}:{v}" for k, v in (stale.get("histogram") or {}).items()) or "–"),
        ("reward (last batch)", _f(rewards.get("last_batch_mean"), 3), "last eval reward",
         f"{_f(last_eval.get('reward_mean'), 3)} (v{_f(last_eval.get('policy_version'))})" if last_eval else "–"),
    ]
    for a, b, c2, d in rows:
        summary.add_row(Text(a, style="dim"), Text(b, style="bold"), Text(c2, style="dim"), Text(d, style="bold"))

    servers = Table(title="inference servers", title_justify="left", expand=False)
    for name, justify in (("server", "left"), ("version", "right"), ("health", "left"), ("outstanding", "right"),
                          ("requests", "right"), ("failures", "right"), ("last sync", "right"), ("error", "left")):
        servers.add_column(name, justify=justify, overflow="fold")
    for s in status["inference_servers"]:
        health = Text("healthy", style="green") if s["healthy"] else Text("failing", style="red")
        servers.add_row(s["url"], _f(s["version"]), health, _f(s["outstanding"]), _f(s["requests"]),
                        _f(s["failures"]), _duration(s.get("last_sync_seconds")), s.get("error") or "")

    batches = Table(title="recent batches", title_justify="left")
    for name in ("step", "samples", "reward", "staleness", "tokens", "generation"):
        batches.add_column(name, justify="right")
    for b in status.get("recent_batches", [])[-8:]:
        batches.add_row(str(b["step"]), str(b["num_samples"]), _f(b["reward_mean"], 3),
                        f"{_f(b['staleness_mean'])} (max {b['staleness_max']})",
                        _f(b.get("completion_tokens_mean"), 1), _duration(b.get("generation_seconds")))

    parts: list[Any] = [header, Panel(summary, title="run", title_align="left"), servers, batches]
    problems = [steps.get("last_error")] + [p.get("error") for p in steps.get("in_progress", [])]
    log_ = status.get("rollout_log") or {}
    if log_.get("last_error"):
        problems.append(f"rollout log: {log_['last_error']}")
    problems = list(dict.fromkeys(p for p in problems if p))
    if problems:
        parts.append(Panel(Text("\n".join(problems), style="red"), title="errors", title_align="left"))
    if log_:
        parts.append(Text(f"rollout log: {log_.get('directory')} ({log_.get('files_written')} files this run)",
                          style="dim"))
    return Group(*parts)


def main(argv: list[str] | None = None, prog: str = "tandem status") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="Pretty-print a Tandem sampler's GET /status.")
    parser.add_argument("--url", default=os.environ.get("TANDEM_SAMPLER_URL", DEFAULT_URL),
                        help="sampler base URL (default: $TANDEM_SAMPLER_URL or %(default)s)")
    parser.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until interrupted")
    parser.add_argument("--count", type=int, default=None, help="with --watch: stop after this many refreshes")
    parser.add_argument("--json", action="store_true", help="print the raw JSON instead")
    parser.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout in seconds")
    parser.add_argument("--api-token", default=os.environ.get(TOKEN_ENV) or None,
                        help=f"the run's token, sent as 'Authorization: Bearer <token>' (default: ${TOKEN_ENV})")
    args = parser.parse_args(argv)
    console = Console()
    err = Console(stderr=True)

    def snapshot() -> Any:
        status = fetch(args.url, args.timeout, args.api_token)
        return status if args.json else render(status, args.url)

    try:
        if args.watch is None:
            shown = snapshot()
            if args.json:
                print(json.dumps(shown, indent=2))
            else:
                console.print(shown)
            return 0
        from rich.live import Live

        done = 0
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while args.count is None or done < args.count:
                shown = snapshot()
                live.update(Text(json.dumps(shown, indent=2)) if args.json else shown, refresh=True)
                done += 1
                if args.count is None or done < args.count:
                    time.sleep(max(args.watch, 0.1))
        return 0
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code == 401:
            # One plain line (no rich markup, no folding): the fix is to pass the token.
            print(refused(prog, args.url, args.api_token), file=sys.stderr)
            return 2
        err.print(f"{prog}: {args.url}/status answered {exc.response.status_code}: {exc.response.text[:300]}")
    except httpx.HTTPError as exc:
        err.print(f"{prog}: cannot reach the sampler at {args.url}: {type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
