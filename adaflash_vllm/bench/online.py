"""Server benchmark runner: one configuration behind a real `vllm serve`, driven by an
async HTTP client at each concurrency of the sweep or window of the shift stream
(streamed completions, so TTFT, TPOT and inter-token gaps are measured as a user
sees them).

tau, verify length and per-position acceptance come from /metrics deltas.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from adaflash_vllm.bench.offline import (
    GAUGES,
    counter_delta,
    gate_extra,
    shift_windows,
    spec_summary,
    swap_extra,
    window_line,
)
from adaflash_vllm.bench.results import Point, add_point, median, percentile
from adaflash_vllm.bench.workloads import output_lengths
from adaflash_vllm.serve_process import ServeProcess, metric_sum, parse_prometheus

_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "rounds": "vllm:adaflash_rounds_total",
    "verified": "vllm:adaflash_verified_tokens_total",
    "ada_accepted": "vllm:adaflash_accepted_tokens_total",
    "spec_rounds": "vllm:adaflash_speculative_rounds_total",
    "spec_verified": "vllm:adaflash_speculative_verified_tokens_total",
}


def _per_pos(values: dict[str, float], name: str) -> list[float]:
    found = {}
    for key, v in values.items():
        if key.startswith(name + "{") and 'position="' in key:
            pos = int(key.split('position="', 1)[1].split('"', 1)[0])
            found[pos] = found.get(pos, 0.0) + v
    return [found[p] for p in sorted(found)]


def scrape(server: ServeProcess) -> dict[str, Any]:
    values = parse_prometheus(server.metrics_text())
    out: dict[str, Any] = {k: metric_sum(values, n) for k, n in _COUNTERS.items()}
    for key, name in GAUGES.items():  # only where the engine exports them
        if any(k == name or k.startswith(name + "{") for k in values):
            out[key] = metric_sum(values, name)
    out["accepted_per_pos"] = _per_pos(
        values, "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    )
    out["ada_drafted_per_pos"] = _per_pos(
        values, "vllm:adaflash_drafted_tokens_per_pos_total"
    )
    out["ada_accepted_per_pos"] = _per_pos(
        values, "vllm:adaflash_accepted_tokens_per_pos_total"
    )
    return out


async def _one_request(session, url: str, body: dict) -> dict[str, Any]:
    t0 = time.perf_counter()
    first, last, gaps, tokens, ok = None, None, [], 0, True
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return {"ok": False, "error": await resp.text()}
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    if first is None:
                        first = now
                    elif last is not None:
                        gaps.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001  (a failed request is counted, not fatal)
        return {"ok": False, "error": repr(e)}
    end = time.perf_counter()
    ttft = (first or end) - t0
    tpot = (end - (first or end)) / max(1, tokens - 1)
    return {
        "ok": ok,
        "ttft": ttft,
        "tpot": tpot,
        "gaps": gaps,
        "tokens": tokens,
        "latency": end - t0,
    }


async def drive(
    url: str,
    model: str,
    prompts: list[str],
    *,
    concurrency: int,
    max_tokens: int | list[int],
    temperature: float,
) -> tuple[list[dict], float]:
    """Send `prompts` with at most `concurrency` in flight; (per-request, wall).
    `max_tokens`: one for all, or one per prompt."""
    import aiohttp

    lengths = (
        list(max_tokens)
        if isinstance(max_tokens, list)
        else [max_tokens] * len(prompts)
    )

    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def run(prompt: str, length: int):
            async with sem:
                return await _one_request(
                    session,
                    url + "/v1/completions",
                    {
                        "model": model,
                        "prompt": prompt,
                        "max_tokens": length,
                        "temperature": temperature,
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    },
                )

        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(run(p, n) for p, n in zip(prompts, lengths, strict=True))
        )
        return list(results), time.perf_counter() - t0


def level_batch(prompts: list[str], c: int, per_slot: int | None = None) -> list[str]:
    """The requests sent at concurrency `c`: at least 8, else `per_slot` (2) per
    slot."""
    n = max(8, (per_slot or 2) * c)
    return (prompts * (n // max(1, len(prompts)) + 1))[:n]


def warm_up(server: ServeProcess, model: str, batch: list[str], c: int) -> None:
    asyncio.run(
        drive(
            server.url,
            model,
            batch[: min(len(batch), c)],
            concurrency=c,
            max_tokens=8,
            temperature=0.0,
        )
    )


def measure_level(
    server: ServeProcess, model: str, batch: list[str], c: int, workload: dict
) -> tuple[float, list[dict], dict[str, Any], dict[str, Any]]:
    """One timed pass of `batch` at concurrency `c`: (tok/s, requests, spec summary,
    drafter version and swaps during the pass)."""
    before = scrape(server)
    reqs, wall = asyncio.run(
        drive(
            server.url,
            model,
            batch,
            concurrency=c,
            max_tokens=output_lengths(
                len(batch),
                workload["max_tokens"],
                workload.get("output_len_spread", 0.0),
            ),
            temperature=workload["temperature"],
        )
    )
    after = scrape(server)
    summary = spec_summary(counter_delta(before, after))
    tok_s = sum(r.get("tokens", 0) for r in reqs) / wall
    return tok_s, reqs, summary, swap_extra(before, after) | gate_extra(before, after)


def add_level_point(
    result: dict,
    workload: dict,
    c: int,
    runs: list[float],
    reqs: list[dict],
    summary: dict,
    extra: dict | None = None,
) -> str:
    """Record concurrency `c` (median of `runs`; `extra` from the last run, e.g.
    the draft gate's skipped share); returns the progress line."""
    runs = sorted(runs)
    add_point(
        result,
        Point(
            key=c,
            phase=workload["phases"][0]["name"],
            requests=len(reqs),
            tok_s=median(runs),
            tok_s_runs=runs,
            extra=extra or {},
            **_latency_fields(reqs, median(runs)),
            **summary,
        ),
    )
    line = (
        f"C={c:3d} {median(runs):8.1f} tok/s tau {summary['tau']:.2f} "
        f"verify {summary['verify_len']:.2f}"
    )
    if extra and "gate_skipped_share" in extra:
        line += f" gate skipped {extra['gate_skipped_share']:.0%} of steps"
    return line


def _latency_fields(reqs: list[dict], tok_s: float) -> dict[str, Any]:
    ok = [r for r in reqs if r["ok"]]
    gaps = [g for r in ok for g in r["gaps"]]
    tokens = sum(r.get("tokens", 0) for r in ok)
    return {
        "output_tokens": tokens,
        "wall_s": tokens / max(tok_s, 1e-9),
        "ttft_ms_p50": 1e3 * median([r["ttft"] for r in ok]) if ok else None,
        "tpot_ms_p50": 1e3 * median([r["tpot"] for r in ok]) if ok else None,
        "itl_ms_p99": 1e3 * percentile(gaps, 99) if gaps else None,
        "failed_requests": len(reqs) - len(ok),
    }


def run_shift_served(
    server: ServeProcess,
    model: str,
    workload: dict,
    result: dict,
    save: Callable[[], None],
    progress: Callable[[str], None],
) -> None:
    """The shift stream through HTTP: each window's requests `window` at a time.

    Each point also records the drafter version at the window's end and the
    swaps during it, so ITL in windows with a swap can be compared with the rest.
    """
    for key, phase, chunk in shift_windows(workload):
        tok_s, reqs, summary, extra = measure_level(
            server, model, chunk, workload["window"], workload
        )
        add_point(
            result,
            Point(
                key=key,
                phase=phase,
                requests=len(chunk),
                tok_s=tok_s,
                tok_s_runs=[tok_s],
                extra=extra,
                **_latency_fields(reqs, tok_s),
                **summary,
            ),
        )
        save()
        progress(window_line(key, phase, tok_s, summary, extra))
