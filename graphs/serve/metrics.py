"""``/metrics``: Prometheus, under vLLM's names so that its dashboards and load tools read them.

    vllm:spec_decode_num_drafts_total              drafts proposed (one per drafting request per step)
    vllm:spec_decode_num_draft_tokens_total        drafted tokens verified
    vllm:spec_decode_num_accepted_tokens_total     of them, accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position}   drafts that accepted > position tokens
    vllm:time_to_first_token_seconds               arrival -> first token (histogram)
    vllm:inter_token_latency_seconds               between a request's successive engine outputs (histogram)
    vllm:request_time_per_output_token_seconds     (latency - TTFT) / (output tokens - 1) (histogram)
    vllm:e2e_request_latency_seconds               arrival -> last token (histogram)
    vllm:num_requests_running / _waiting           requests holding a K/V row / queued for one (gauges)
    vllm:prompt_tokens_total, vllm:generation_tokens_total
    vllm:request_success_total{finished_reason}    stop | length | abort | error (a failed request, a
                                                   deadline before its first token, a shutdown)
    specexport:requests_rejected_total{reason}     refused before the engine: bad_request, auth,
                                                   body_too_large, capacity, busy, internal, timeout, ...
    specexport:engine_steps_total                  engine steps (base forwards after prefill)
    specexport:plain_steps_total                   of them, steps where no row drafted (adaptive chose
                                                   plain decoding, or every row asked speculation off)
    specexport:kv_allocated_bytes                  host K/V allocated now (the budget: _budget_bytes)
    specexport:engine_step_seconds                 time inside engine.step() (gauge: the total so far)
    specexport:worker_overhead_seconds             the engine thread's time around its steps: the server's
                                                   own cost on that thread (commands, events, metrics)

Every series has a ``model_name`` label. Times are measured on the engine's thread when the step
emitted the tokens (as vLLM's engine-side stats), not when a slow client read them.
"""

from __future__ import annotations

from graphs.serve.protocol import FINISH

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    def __init__(self, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.model = model_name

        def counter(name, doc, extra=()):
            return Counter(name, doc, [*lab, *extra], registry=r)

        self.drafts = counter("vllm:spec_decode_num_drafts", "Speculative drafts proposed (per request per step)")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens verified")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted")
        self.per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                               "Drafts that accepted more than `position` tokens", ["position"])
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.success = counter("vllm:request_success", "Finished requests", ["finished_reason"])
        self.steps = counter("specexport:engine_steps", "Engine decode steps")
        self.plain_steps = counter("specexport:plain_steps", "Engine steps in which no request drafted")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", lab, buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between a request's successive outputs", lab,
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "(latency - TTFT) / (output tokens - 1)",
                              lab, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token", lab, buckets=E2E_BUCKETS,
                             registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests holding a K/V row", lab, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a K/V row", lab, registry=r)
        self.kv_bytes = Gauge("specexport:kv_allocated_bytes", "Host K/V memory allocated", lab, registry=r)
        self.kv_budget = Gauge("specexport:kv_budget_bytes", "Host K/V memory the engine may allocate", lab,
                               registry=r)
        self.rejected = counter("specexport:requests_rejected", "Requests refused", ["reason"])
        self.step_seconds = Gauge("specexport:engine_step_seconds", "Seconds spent inside engine.step()", lab,
                                  registry=r)
        self.worker_seconds = Gauge("specexport:worker_overhead_seconds",
                                    "Seconds the engine's thread spent around its steps (commands, events, metrics)",
                                    lab, registry=r)
        self._steps_seen = self._plain_seen = 0
        # the children of this model's label, bound once (a labels() lookup per event costs a lock and a dict)
        for name in ("drafts", "draft_tokens", "accepted", "prompt_tokens", "generation_tokens", "steps", "plain_steps",
                     "ttft", "itl", "tpot", "e2e", "running", "waiting", "kv_bytes", "kv_budget", "step_seconds",
                     "worker_seconds"):
            setattr(self, "_" + name, getattr(self, name).labels(model_name))

    def observe(self, h, ev, live_req, now: float) -> None:
        """One event of one request (the engine's thread). ``live_req``: the engine's Request while live."""
        n = len(ev.token_ids)
        if n:
            self._generation_tokens.inc(n)
            if h.t_first is None:
                h.t_first = now
                self._ttft.observe(now - h.arrival)
            else:
                self._itl.observe(now - h.t_last)
            h.t_last = now
        stats = ev.stats if ev.stats is not None else (live_req.stats if live_req is not None else None)
        if stats is not None:
            self._spec(h, stats)
        if ev.finish_reason is not None and self.finished(h, finished_reason(ev)):
            self._prompt_tokens.inc(h.prompt_tokens)
            self._e2e.observe(now - h.arrival)
            out = stats.new_tokens if stats is not None else 0
            if out > 1 and h.t_first is not None:
                self._tpot.observe((now - h.t_first) / (out - 1))

    def finished(self, h, reason: str) -> bool:
        """Count a request's end once, whoever reports it first (the worker's event, or the app for an
        error the worker delivers without observing it, a queue timeout, a shutdown); False if counted."""
        if getattr(h, "finish_counted", False):
            return False
        h.finish_counted = True
        self.success.labels(self.model, reason).inc()
        return True

    def reject(self, reason: str) -> None:
        """A request refused before the engine saw it (the status's reason: see app.REJECT_REASONS)."""
        self.rejected.labels(self.model, reason).inc()

    def _spec(self, h, st) -> None:
        seen = h.seen
        for key, metric, value in (("drafts", self._drafts, st.speculative_steps),
                                   ("draft_tokens", self._draft_tokens, st.draft_tokens),
                                   ("accepted", self._accepted, st.accepted_drafts)):
            d = value - seen.get(key, 0)
            if d > 0:
                metric.inc(d)
                seen[key] = value
        pos = seen.setdefault("per_pos", [])
        for k, v in enumerate(st.accepted_per_pos):
            old = pos[k] if k < len(pos) else 0
            if v > old:
                self.per_pos.labels(self.model, str(k)).inc(v - old)
        seen["per_pos"] = list(st.accepted_per_pos)

    def engine_step(self, engine, snapshot: dict) -> None:
        tot = engine.totals
        if tot.steps < self._steps_seen:  # a rebuilt engine starts again from zero
            self._steps_seen = self._plain_seen = 0
        if tot.steps > self._steps_seen:
            self._steps.inc(tot.steps - self._steps_seen)
        if tot.plain_steps > self._plain_seen:
            self._plain_steps.inc(tot.plain_steps - self._plain_seen)
        self._steps_seen, self._plain_seen = tot.steps, tot.plain_steps
        self.gauges(snapshot)

    def times(self, step_seconds: float, worker_seconds: float) -> None:
        self._step_seconds.set(step_seconds)
        self._worker_seconds.set(worker_seconds)

    def gauges(self, snapshot: dict) -> None:
        self._running.set(snapshot["running"])
        self._waiting.set(snapshot["waiting"])
        self._kv_bytes.set(snapshot["kv_allocated_bytes"])
        self._kv_budget.set(snapshot["kv_budget_bytes"])

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def finished_reason(ev) -> str:
    """vLLM's finished_reason of a last event: stop | length | abort, or error for a failure, an
    unknown reason, or a deadline that passed before any token (the request waited in the queue: the
    client gets a 503, not a 200)."""
    reason = ev.finish_reason
    if reason == "deadline" and not (ev.stats is not None and ev.stats.new_tokens):
        return "error"
    return FINISH.get(reason, "error")


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
