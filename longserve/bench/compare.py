"""`longserve bench compare --config compare.yaml`: one seeded workload against several endpoints in turn
(optionally a max-concurrency sweep), then a report folder: report.md (Markdown tables), results.json (every
run with its per-request records) and PNG plots. The YAML's workload keys are `bench serve` flag names."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from typing import Any

from longserve.bench.backends import BACKENDS
from longserve.bench.report import git_commit, markdown_table
from longserve.bench.server_api import Server

_PER_ENDPOINT = ("base_url", "backend", "endpoint", "model", "api_key", "output_json")
ENDPOINT_KEYS = {"name", "base_url", "backend", "endpoint", "model", "api_key", "api_key_env", "tokenizer"}


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FILE.yaml", help="workload and endpoints (YAML)")
    p.add_argument("--output-dir", help="report folder (default: the config's output_dir, else bench-report)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bars")


def load_config(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path} is not valid YAML: {e}") from None
    if (
        not isinstance(config, dict)
        or not config.get("endpoints")
        or not isinstance(config["endpoints"], list)
    ):
        raise ValueError(f"--config {path} needs an `endpoints:` list (name, base_url, backend)")
    unknown = set(config) - {"workload", "endpoints", "output_dir"}
    if unknown:
        raise ValueError(
            f"--config {path}: unknown keys {sorted(unknown)}; known: workload, endpoints, output_dir"
        )
    names = set()
    for i, ep in enumerate(config["endpoints"]):
        if not isinstance(ep, dict) or not {"name", "base_url"} <= set(ep):
            raise ValueError(f"--config {path}: endpoint {i} needs at least `name` and `base_url`")
        if extra := set(ep) - ENDPOINT_KEYS:
            raise ValueError(f"--config {path}: endpoint {ep['name']!r}: unknown keys {sorted(extra)}")
        if ep.get("backend", "longserve") not in BACKENDS:
            raise ValueError(f"endpoint {ep['name']!r}: backend must be one of {', '.join(BACKENDS)}")
        if ep["name"] in names:
            raise ValueError(f"--config {path}: endpoint name {ep['name']!r} appears twice")
        names.add(ep["name"])
    return config


def workload_args(workload: dict[str, Any] | None) -> tuple[argparse.Namespace, list[int | None]]:
    """The `bench serve` namespace of the workload keys (validated by its parser) and the concurrency sweep."""
    from longserve.bench.serve import add_serve_args

    parser = argparse.ArgumentParser(prog="compare.yaml workload", exit_on_error=False)
    add_serve_args(parser)
    actions = {a.dest: a for a in parser._actions}
    workload = dict(workload or {})
    sweep = workload.pop("max_concurrency", workload.pop("max-concurrency", None))
    concurrency = sweep if isinstance(sweep, list) else [sweep]
    argv = ["--base-url", "-"]
    for key, value in workload.items():
        dest = key.replace("-", "_")
        if dest not in actions or dest in _PER_ENDPOINT:
            raise ValueError(f"workload: unknown key {key!r} (use `longserve bench serve` flag names)")
        flag = actions[dest].option_strings[0]
        if actions[dest].nargs == 0:  # store_true
            argv += [flag] if value else []
        else:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    try:
        args = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(f"workload: {e}") from None
    return args, concurrency


def run_compare(config: dict[str, Any], output_dir: str, disable_tqdm: bool = False) -> dict[str, Any]:
    from longserve.bench.plots import write_plots
    from longserve.bench.serve import format_summary, prepare, run_once

    base, concurrency = workload_args(config.get("workload"))
    base.disable_tqdm = base.disable_tqdm or disable_tqdm
    endpoints = []
    for ep in config["endpoints"]:  # all reachable before the first long run
        key = ep.get("api_key") or (os.environ.get(ep["api_key_env"]) if ep.get("api_key_env") else None)
        server = Server(ep["base_url"], key)
        server.check_reachable()
        endpoints.append((ep, server))
    runs = []
    for ep, server in endpoints:
        args = argparse.Namespace(**vars(base))
        args.base_url, args.backend = ep["base_url"], ep.get("backend", "longserve")
        args.endpoint, args.model = ep.get("endpoint", "completions"), ep.get("model")
        args.tokenizer = ep.get("tokenizer", args.tokenizer)
        workload = prepare(args, server)
        for c in concurrency:
            args.max_concurrency = c
            record = run_once(args, server, workload)
            print(f"--- {ep['name']} (max concurrency {c or '-'})\n{format_summary(record)}", file=sys.stderr)
            runs.append({"name": ep["name"], "max_concurrency": c, **record})
    os.makedirs(output_dir, exist_ok=True)
    sweep = len(concurrency) > 1
    plots = write_plots(runs, sweep, output_dir)
    commit, dirty = git_commit()
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["longserve", *sys.argv[1:]]),
        "commit": commit,
        "dirty": dirty,
        "workload": {k: v for k, v in vars(base).items() if k not in ("base_url", "api_key", "output_json")},
        "max_concurrency": concurrency,
        "plots": plots,
    }
    report = {"metadata": meta, "runs": runs}
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(output_dir, "report.md"), "w") as f:
        f.write(markdown_report(report))
    return report


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


_SERVER_FACTS = ("chunked_prefill_size", "page_size", "dtype", "max_model_len", "version")


def markdown_report(report: dict[str, Any]) -> str:
    meta, runs = report["metadata"], report["runs"]
    w = meta["workload"]
    lines = [
        "# Serving benchmark comparison",
        "",
        f"{meta['date']}, commit {meta['commit'] or '?'}{' (dirty)' if meta['dirty'] else ''}: `{meta['command']}`",
        "",
        f"Workload: `{w['dataset']}`, {runs[0]['metadata']['num_prompts'] if runs else 0} requests, seed "
        f"{w['seed']}, request rate {w['request_rate']}, max concurrency {meta['max_concurrency']}, "
        f"cache flushed before each run: {_flushed(w, runs)}.",
        "",
        "## Endpoints",
        "",
    ]
    seen: dict[str, dict[str, Any]] = {}
    for run in runs:
        seen.setdefault(run["name"], run["metadata"])
    rows = []
    for name, m in seen.items():
        info = m["server_info"]
        extra = ", ".join(f"{k} {info[k]}" for k in _SERVER_FACTS if k in info)
        model = str(m["model"] or info.get("model", "-"))
        flush = m.get("cache_flushed") or ("FAILED" if m.get("cache_flush_error") else "-")
        rows.append([name, m["backend"], m["endpoint"], m["base_url"], model, extra, flush])
    header = ["endpoint", "backend", "API", "URL", "model", "server", "cache flush"]
    table = markdown_table(header, rows, numeric=False)
    lines += [table, "", "## Results", ""]
    header = ["endpoint", "conc.", "ok/failed", "TTFT mean", "TTFT p50", "TTFT p95", "TTFT p99", "ITL mean",
              "ITL p50", "ITL p95", "TPOT mean", "E2E mean", "req/s", "out tok/s", "cache hit",
              "cache hit /metrics"]  # fmt: skip
    rows = []
    for run in runs:
        s, sm = run["summary"], run["server_metrics"] or {}
        rows.append([
            run["name"], str(run["max_concurrency"] or "-"), f"{s['completed']}/{s['failed']}",
            _ms(s["ttft"]["mean"]), _ms(s["ttft"]["median"]), _ms(s["ttft"]["p95"]), _ms(s["ttft"]["p99"]),
            _ms(s["itl"]["mean"]), _ms(s["itl"]["median"]), _ms(s["itl"]["p95"]), _ms(s["tpot"]["mean"]),
            _ms(s["e2e"]["mean"]),
            f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
            _pct(s["cache_hit_rate"]), _pct(sm.get("prefix_cache_hit_rate")),
        ])  # fmt: skip
    lines += [markdown_table(header, rows), "", "Latencies in ms, measured on the client (streaming)."]
    lines += _ttft_by_length(runs)
    errors = [
        (run["name"], f"the cache was NOT flushed before this run: {run['metadata']['cache_flush_error']}")
        for run in runs
        if run["metadata"].get("cache_flush_error")
    ]
    errors += [(run["name"], e) for run in runs for e in run["summary"]["errors"]]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {name}: {e}" for name, e in errors]
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in meta["plots"]]
    return "\n".join(lines) + "\n"


def _flushed(workload: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    if not workload["flush_cache"]:
        return "no"
    failed = sorted({run["name"] for run in runs if run["metadata"].get("cache_flush_error")})
    return f"asked, but **FAILED** for {', '.join(failed)} (see Errors)" if failed else "yes"


def _ttft_by_length(runs: list[dict[str, Any]]) -> list[str]:
    """Median TTFT per prompt length (client-planned, grouped within 10%) when a run mixes a few lengths
    (long-doc): a mean over 8K and 64K prompts says little. Empty for other workloads."""
    if not runs or runs[0]["metadata"]["dataset"] != "long-doc":
        return []
    lengths = sorted({r["prompt_len"] for run in runs for r in run["requests"]})
    groups: list[list[int]] = []
    for n in lengths:
        if groups and n <= 1.1 * groups[-1][0]:
            groups[-1].append(n)
        else:
            groups.append([n])
    header = ["endpoint", "conc."] + [
        f"TTFT p50 @{g[0]}-{g[-1]}" if len(g) > 1 else f"TTFT p50 @{g[0]}" for g in groups
    ]
    rows = []
    for run in runs:
        row = [run["name"], str(run["max_concurrency"] or "-")]
        for g in groups:
            ttfts = sorted(
                r["ttft"] for r in run["requests"] if r["success"] and g[0] <= r["prompt_len"] <= g[-1]
            )
            row.append(_ms((ttfts[(len(ttfts) - 1) // 2] + ttfts[len(ttfts) // 2]) / 2 if ttfts else None))
        rows.append(row)
    return ["", "### TTFT by prompt length (tokens)", "", markdown_table(header, rows)]


def run_from_args(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    output_dir = args.output_dir or config.get("output_dir") or "bench-report"
    report = run_compare(config, output_dir, args.disable_tqdm)
    print(markdown_report(report))
    plots = ", ".join(report["metadata"]["plots"])
    print(f"report written to {output_dir}/ (report.md, results.json, {plots})")
    flush_failed = [run["name"] for run in report["runs"] if run["metadata"].get("cache_flush_error")]
    if flush_failed:
        print(
            f"error: the prefix cache was not flushed before the runs of {', '.join(flush_failed)}",
            file=sys.stderr,
        )
    return 0 if all(run["summary"]["completed"] for run in report["runs"]) and not flush_failed else 1
