"""``coral bench``: replay a trace or Poisson load against any OpenAI-compatible server and report like ``vllm bench serve``.

One async load generator (httpx on asyncio) for ``coral bench``, the lifecycle soak and the
fidelity experiment. Each request is a streaming ``/v1/completions`` call (token-id prompt,
``ignore_eos`` so the output length is the trace's), timed on arrival of each chunk: TTFT
(first token), ITL (gaps between chunks), TPOT ((E2EL - TTFT) / (output tokens - 1)) and
E2EL. Concurrency is bounded (``--max-concurrency``; 0 = open loop): an arrival waits for
a free slot, as in vLLM's tool, and the connection pool holds one kept-alive connection
per slot. Every request sent is accounted for: ``sent = completed + failed``.
"""

from __future__ import annotations

import asyncio
import json
import math
import ssl
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import click
import numpy as np

__all__ = ["BenchReport", "RequestResult", "bench_serve", "one_request", "replay", "run_bench", "server_max_context", "workload"]


@dataclass(slots=True)
class RequestResult:
    """One request's outcome and timings (seconds; ``*_at_s`` from the replay's start)."""

    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    status: int = 0
    #: "completed"; "refused" (an error status, or an error event in the stream: the server said why);
    #: "cut" (the stream broke off: a connection closed or reset mid-answer, no [DONE]); "failed" (no answer)
    outcome: str = "failed"
    sent_at_s: float = math.nan
    first_at_s: float = math.nan
    last_at_s: float = math.nan


_SSL: list[Any] = []


def _client(max_connections: int, timeout_s: float) -> Any:
    # lazy: httpx (runtime extra; `coral --help` lists bench without it)
    import httpx

    if not _SSL:  # building the default context (the CA bundle) costs ~25 ms of CPU: once per process
        _SSL.append(ssl.create_default_context())
    n = max(1, max_connections)
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
        timeout=httpx.Timeout(timeout_s, connect=timeout_s, pool=None), verify=_SSL[0],
    )  # fmt: skip


async def _stream_one(
    client: Any, url: str, model: str, prompt: Sequence[int], max_tokens: int, *,
    api_key: str | None, ignore_eos: bool, t0: float,
) -> RequestResult:  # fmt: skip
    # lazy: httpx (runtime extra; `coral --help` lists bench without it)
    import httpx

    body: dict[str, Any] = {
        "model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    if ignore_eos:
        body["ignore_eos"] = True
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    res = RequestResult(ok=False, prompt_tokens=len(prompt))
    start = time.perf_counter()
    res.sent_at_s = start - t0
    last = start
    chunks = 0
    usage_tokens = -1
    try:
        async with client.stream("POST", url.rstrip("/") + "/v1/completions", content=json.dumps(body), headers=headers) as r:
            res.status = r.status_code
            if r.status_code != 200:
                text = (await r.aread())[:2000].decode("utf-8", "replace")
                res.error = f"HTTP {r.status_code}: {text}"
                res.outcome = "refused"
                return res
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                ev = json.loads(payload)
                if "error" in ev:
                    res.error = str(ev["error"].get("message", ev["error"]))
                    res.outcome = "refused"
                    return res
                if ev.get("usage"):
                    usage_tokens = int(ev["usage"].get("completion_tokens", -1))
                choices = ev.get("choices") or []
                if not choices or not (choices[0].get("text") or choices[0].get("token_ids")):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft_s = now - start
                    res.first_at_s = now - t0
                else:
                    res.itl_s.append(now - last)
                last = now
                res.last_at_s = now - t0
                chunks += 1
                res.output_tokens += len(choices[0].get("token_ids") or [0])
        res.e2el_s = time.perf_counter() - start
        if usage_tokens >= 0:
            res.output_tokens = usage_tokens
        res.ok = chunks > 0 and done
        res.outcome = "completed" if res.ok else "cut"
        if not res.ok:
            res.error = "the stream ended without [DONE]" if chunks else "no token in the stream"
    except (httpx.HTTPError, OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        # a break after the answer began is a cut stream; before it, no answer at all
        res.outcome = "cut" if res.status == 200 else "failed"
    return res


async def replay_async(
    url: str, model: str, arrival_s: Sequence[float] | np.ndarray, prompts: Sequence[Sequence[int]],
    output_tokens: Sequence[int] | np.ndarray, *, api_key: str | None = None, max_concurrency: int = 64,
    timeout_s: float = 120.0, ignore_eos: bool = True,
) -> tuple[list[RequestResult], float]:  # fmt: skip
    """Send request ``i`` at ``arrival_s[i]`` (waiting for a free slot) and time its stream.

    Args:
        url: the server's base URL.
        model: the model name.
        arrival_s: send times from the start, seconds (sorted).
        prompts: token ids per request.
        output_tokens: ``max_tokens`` per request.
        api_key: bearer token, if the server needs one.
        max_concurrency: requests in flight at most; 0 = no bound (open loop).
        timeout_s: per-request timeout (connect, and each read).
        ignore_eos: ask for exactly the output length.

    Returns:
        (every request's result in order, the wall time of the whole replay).
    """
    n = len(prompts)
    bound = max_concurrency if max_concurrency > 0 else max(1, n)
    slots = asyncio.Semaphore(bound)
    t0 = time.perf_counter()
    async with _client(bound, timeout_s) as client:

        async def one(i: int) -> RequestResult:
            try:
                return await asyncio.wait_for(
                    _stream_one(client, url, model, prompts[i], int(output_tokens[i]), api_key=api_key, ignore_eos=ignore_eos, t0=t0),
                    timeout_s * 4,
                )  # fmt: skip
            except TimeoutError:
                return RequestResult(ok=False, prompt_tokens=len(prompts[i]), error="no answer in time")
            finally:
                slots.release()

        tasks = []
        for i in range(n):
            delay = t0 + float(arrival_s[i]) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            tasks.append(asyncio.create_task(one(i)))
        results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - t0


def one_request(
    url: str,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    api_key: str | None = None,
    timeout_s: float = 120.0,
    ignore_eos: bool = True,
) -> RequestResult:
    """Send one streaming completion and time it (a blocking wrapper of the async client).

    Args:
        url: the server's base URL (``http://host:port``).
        model: the model name.
        prompt: token ids.
        max_tokens: tokens to generate.
        api_key: sent as a bearer token if given.
        timeout_s: connect / read timeout.
        ignore_eos: ask for exactly ``max_tokens`` tokens.

    Returns:
        The result; never raises for server or network errors (they are the result's error).
    """
    results, _ = asyncio.run(replay_async(url, model, [0.0], [list(prompt)], [max_tokens], api_key=api_key,
                                          max_concurrency=1, timeout_s=timeout_s, ignore_eos=ignore_eos))  # fmt: skip
    return results[0]


def replay(
    url: str, model: str, arrival_s: Sequence[float] | np.ndarray, prompts: Sequence[Sequence[int]],
    output_tokens: Sequence[int] | np.ndarray, **kw: Any,
) -> list[RequestResult]:  # fmt: skip
    """Blocking :func:`replay_async` (same arguments); returns the results only."""
    return asyncio.run(replay_async(url, model, arrival_s, prompts, output_tokens, **kw))[0]


def server_max_context(url: str, model: str, api_key: str | None = None, timeout_s: float = 10.0) -> int | None:
    """The model's ``max_model_len`` from the server's ``GET /v1/models`` (None if it does not say).

    Raises:
        click.ClickException: if the server cannot be reached or does not serve ``model``.
    """
    # lazy: httpx (runtime extra; `coral --help` lists bench without it)
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise click.ClickException(f"cannot reach {url}/v1/models: {e}") from None
    if r.status_code != 200:
        raise click.ClickException(f"{url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        cards = r.json()["data"]
    except (ValueError, KeyError, TypeError):
        raise click.ClickException(f"{url}/v1/models did not return a model list") from None
    card = next((c for c in cards if isinstance(c, dict) and c.get("id") == model), None)
    if card is None:
        served = ", ".join(str(c.get("id")) for c in cards if isinstance(c, dict)) or "(none)"
        raise click.ClickException(f"the server does not serve model {model!r}; it serves: {served} (--model)")
    ctx = card.get("max_model_len")
    return int(ctx) if isinstance(ctx, int) and ctx > 1 else None


def workload(
    *, trace: str | None, rate_per_s: float | None, duration_s: float, seed: int = 0,
    prompt_tokens: int = 32, output_tokens: int = 16, max_context: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Arrival times and lengths: a trace file (cut to ``duration_s``) or Poisson arrivals.

    Args:
        trace: a trace file :func:`coral.workload.load_trace_file` reads, or None.
        rate_per_s: Poisson rate when there is no trace.
        duration_s: the window.
        seed: random seed.
        prompt_tokens, output_tokens: mean lengths of synthetic requests (lognormal).
        max_context: clip prompt + output to fit.

    Returns:
        (arrival seconds, prompt lengths, output lengths).
    """
    # lazy: pydantic (via coral.workload): `coral --help` lists bench without loading it
    from coral.workload import LognormalLengths, load_trace_file, synthesize
    from coral.workload.lengths import Lognormal

    rng = np.random.default_rng(seed)
    if trace:
        t = load_trace_file(trace).trace
        keep = t.arrival_s - (t.arrival_s[0] if len(t.arrival_s) else 0.0) < duration_s
        arrival, prompt, output = t.arrival_s[keep] - (t.arrival_s[0] if len(t.arrival_s) else 0.0), t.prompt_tokens[keep], t.output_tokens[keep]
    else:
        if rate_per_s is None or rate_per_s <= 0:
            raise ValueError("give a trace file or a positive rate")
        lengths = LognormalLengths(prompt=Lognormal.from_mean(prompt_tokens), output=Lognormal.from_mean(output_tokens))
        t = synthesize(name="poisson", rate_per_s=rate_per_s, duration_s=duration_s, lengths=lengths, rng=rng)
        arrival, prompt, output = t.arrival_s, t.prompt_tokens, t.output_tokens
    prompt = np.maximum(1, np.asarray(prompt, dtype=np.int64))
    output = np.maximum(1, np.asarray(output, dtype=np.int64))
    if max_context:
        prompt = np.minimum(prompt, max_context // 2)
        output = np.minimum(output, max_context - prompt)
    return np.asarray(arrival, dtype=np.float64), prompt, output


@dataclass(slots=True)
class BenchReport:
    """The figures of ``vllm bench serve`` (times in ms)."""

    sent: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_concurrency: int
    goodput_req_per_s: float | None = None
    refused: int = 0  # of failed: the server answered with an error (HTTP status or an in-stream error event)
    cut: int = 0  # of failed: streams that broke off mid-answer
    stats_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    #: each cut or unanswered request (not only the first errors, which refusals may fill): "outcome at
    #: <send time> s (HTTP status, tokens received): error"; the JSON keeps the first 50
    lost: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """A flat dict (vLLM's key names where they exist)."""
        out = asdict(self)
        for metric, st in self.stats_ms.items():
            for k, v in st.items():
                out[f"{k}_{metric}_ms"] = v
        out["errors"] = self.errors[:20]
        out["lost"] = self.lost[:50]
        return out

    def render(self) -> str:
        """The text report, laid out like vLLM's."""
        w = 40
        lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
        row = lambda k, v: lines.append(f"{k:<{w}}{v:<10}")  # noqa: E731
        row("Successful requests:", self.completed)
        row("Failed requests:", self.failed)
        if self.failed:
            row("  refused with an error / cut streams:", f"{self.refused} / {self.cut}")
        row("Maximum request concurrency:", self.max_concurrency)
        row("Benchmark duration (s):", f"{self.duration_s:.2f}")
        row("Total input tokens:", self.total_input_tokens)
        row("Total generated tokens:", self.total_output_tokens)
        row("Request throughput (req/s):", f"{self.request_throughput:.2f}")
        if self.goodput_req_per_s is not None:
            row("Request goodput (req/s):", f"{self.goodput_req_per_s:.2f}")
        row("Output token throughput (tok/s):", f"{self.output_throughput:.2f}")
        row("Total Token throughput (tok/s):", f"{self.total_token_throughput:.2f}")
        titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)", "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
        for metric, title in titles.items():
            st = self.stats_ms.get(metric, {})
            lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
            row(f"Mean {metric.upper()} (ms):", f"{st.get('mean', 0.0):.2f}")
            row(f"Median {metric.upper()} (ms):", f"{st.get('median', 0.0):.2f}")
            row(f"P99 {metric.upper()} (ms):", f"{st.get('p99', 0.0):.2f}")
        lines.append("=" * 50)
        return "\n".join(lines)


def _stats(xs: Sequence[float]) -> dict[str, float]:
    if not xs:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    a = np.asarray(xs) * 1e3
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def run_bench(
    url: str,
    model: str,
    arrival_s: Sequence[float] | np.ndarray,
    prompt_tokens: Sequence[int] | np.ndarray,
    output_tokens: Sequence[int] | np.ndarray,
    *,
    api_key: str | None = None,
    max_concurrency: int = 64,
    goodput_ms: dict[str, float] | None = None,
    timeout_s: float = 120.0,
    vocab: int = 256,
    seed: int = 0,
    ignore_eos: bool = True,
) -> tuple[BenchReport, list[RequestResult]]:
    """Replay arrivals against a server and measure.

    Args:
        url: the server's base URL.
        model: the model name.
        arrival_s: send times from the start, seconds (sorted).
        prompt_tokens, output_tokens: lengths per request.
        api_key: bearer token, if the server needs one.
        max_concurrency: requests in flight at most (later arrivals wait for a slot); 0 = no bound.
        goodput_ms: SLOs, e.g. ``{"ttft": 500, "tpot": 50}``; a request counts for goodput
            if it meets all of them.
        timeout_s: per-request socket timeout.
        vocab: prompt token ids are drawn from ``[3, vocab)``.
        seed: prompt contents.
        ignore_eos: ask for exactly the output length.

    Returns:
        (the report, every request's result).
    """
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, max(4, vocab), size=int(p)).tolist() for p in prompt_tokens]
    done, duration = asyncio.run(replay_async(url, model, arrival_s, prompts, output_tokens, api_key=api_key,
                                              max_concurrency=max_concurrency, timeout_s=timeout_s, ignore_eos=ignore_eos))  # fmt: skip
    n = len(done)
    ok = [r for r in done if r.ok]
    tpots = [(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    stats = {
        "ttft": _stats([r.ttft_s for r in ok]),
        "tpot": _stats(tpots),
        "itl": _stats([x for r in ok for x in r.itl_s]),
        "e2el": _stats([r.e2el_s for r in ok]),
    }
    goodput = None
    if goodput_ms:
        good = 0
        for r in ok:
            tpot = (r.e2el_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            vals = {"ttft": r.ttft_s * 1e3, "tpot": tpot * 1e3, "e2el": r.e2el_s * 1e3}
            good += all(vals[k] <= v for k, v in goodput_ms.items())
        goodput = good / duration
    tin = sum(r.prompt_tokens for r in ok)
    tout = sum(r.output_tokens for r in ok)
    report = BenchReport(
        sent=n, completed=len(ok), failed=n - len(ok), duration_s=duration, total_input_tokens=tin,
        total_output_tokens=tout, request_throughput=len(ok) / duration, output_throughput=tout / duration,
        total_token_throughput=(tin + tout) / duration, max_concurrency=max_concurrency, goodput_req_per_s=goodput,
        stats_ms=stats, errors=[r.error for r in done if not r.ok],
        refused=sum(r.outcome == "refused" for r in done), cut=sum(r.outcome == "cut" for r in done),
        lost=[f"{r.outcome} at {r.sent_at_s:.1f} s (HTTP {r.status}, {r.output_tokens} tokens): {r.error}"
              for r in done if r.outcome in ("cut", "failed")],
    )  # fmt: skip
    return report, done


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (or one string with spaces/commas) -> ``{"ttft": 500.0, "tpot": 50.0}``.

    Raises:
        click.BadParameter: on an unknown metric or a bad number.
    """
    out: dict[str, float] = {}
    for item in " ".join(items).replace(",", " ").split():
        k, _, v = item.partition(":")
        if k not in ("ttft", "tpot", "e2el"):
            raise click.BadParameter(f"unknown goodput metric {k!r}; use ttft, tpot or e2el", param_hint="--goodput")
        try:
            out[k] = float(v)
        except ValueError:
            raise click.BadParameter(f"bad milliseconds in {item!r}", param_hint="--goodput") from None
        if not math.isfinite(out[k]) or out[k] <= 0:
            raise click.BadParameter(f"{item!r}: milliseconds must be positive", param_hint="--goodput")
    return out


@click.command(name="bench")
@click.option("--url", required=True, help="Base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000.")
@click.option("--model", required=True, help="Model name to request.")
@click.option("--trace", type=click.Path(dir_okay=False, exists=True), default=None, help="Trace file to replay (Azure, BurstGPT or arrival_s,prompt_tokens,output_tokens CSV).")
@click.option("--rate", type=float, default=None, help="Poisson arrival rate (req/s) when there is no trace.")
@click.option("--duration-s", type=float, required=True, help="Window to replay / generate, seconds.")
@click.option("--goodput", multiple=True, help="SLOs in ms, e.g. --goodput 'ttft:500 tpot:50'.")
@click.option("--max-concurrency", type=click.IntRange(min=0), default=64, show_default=True, help="Requests in flight at most (0 = no bound).")
@click.option("--prompt-tokens", type=int, default=32, show_default=True, help="Mean prompt length (Poisson load).")
@click.option("--output-tokens", type=int, default=16, show_default=True, help="Mean output length (Poisson load).")
@click.option("--max-context", type=int, default=None, help="Clip prompt + output to this many tokens (default: the model's max_model_len from the server's /v1/models).")
@click.option("--vocab", type=int, default=256, show_default=True, help="Prompt token ids are drawn from [3, vocab).")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="Bearer key (default $OPENAI_API_KEY).")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed of arrivals, lengths and prompts.")
@click.option("--timeout-s", type=float, default=120.0, show_default=True, help="Per-request timeout.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of the table.")
def bench_serve(
    url: str, model: str, trace: str | None, rate: float | None, duration_s: float, goodput: tuple[str, ...],
    max_concurrency: int, prompt_tokens: int, output_tokens: int, max_context: int | None, vocab: int,
    api_key: str | None, seed: int, timeout_s: float, as_json: bool,
) -> None:  # fmt: skip
    """Replay a trace or Poisson load against an OpenAI-compatible server (ours or vLLM) and report TTFT, TPOT, ITL, E2EL.

    Exits 1 when every request failed (nothing was measured), 2 on bad options."""
    if (trace is None) == (rate is None):
        raise click.UsageError("give exactly one of --trace and --rate")
    slo = parse_goodput(goodput)
    if max_context is None:
        max_context = server_max_context(url, model, api_key)
    try:
        arrival, prompt, output = workload(
            trace=trace, rate_per_s=rate, duration_s=duration_s, seed=seed, prompt_tokens=prompt_tokens,
            output_tokens=output_tokens, max_context=max_context,
        )  # fmt: skip
    except Exception as e:
        raise click.ClickException(str(e)) from None
    report, _ = run_bench(url, model, arrival, prompt, output, api_key=api_key, max_concurrency=max_concurrency,
                          goodput_ms=slo or None, timeout_s=timeout_s, vocab=vocab, seed=seed)  # fmt: skip
    click.echo(json.dumps(report.to_json(), indent=2) if as_json else report.render())
    if report.failed:
        click.echo(f"{report.failed} of {report.sent} requests failed; first: {report.errors[0]}", err=True)
    if report.sent and report.failed == report.sent:  # nothing was measured: a dead URL, a wrong model
        click.echo(f"error: every request to {url} failed; is an OpenAI-compatible server serving {model!r} there?",
                   err=True)
        sys.exit(1)
