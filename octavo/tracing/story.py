"""What a run did, in sentences read from its trace: which step completed each prompt (and why some waited),
and when each request therefore finished. The demo prints these instead of a prediction, so the text always
matches the log below it, at every block size, budget and arrival pattern.

The rule every sentence rests on: the step that completes a request's prompt also samples its first token, and
each later step it is scheduled in samples one more, so a request of g tokens that is never preempted finishes
g - 1 steps after the step that completed its prompt.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from octavo.tracing.spans import DECODE, PREFILL, RequestSpan
from octavo.tracing.timeline import label_of


def prompt_done_step(span: RequestSpan) -> int | None:
    """The step that completed SPAN's prompt (its last prefill step before its first decode), or None."""
    done = None
    for step in sorted(span.states):
        state = span.states[step]
        if state == PREFILL:
            done = step
        elif state == DECODE:
            break
    return done


def _names(ids: list[str], limit: int = 4) -> str:
    if len(ids) <= limit:
        return ", ".join(map(label_of, ids))
    return f"{', '.join(map(label_of, ids[:limit - 1]))} and {len(ids) - limit + 1} more"


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def describe_run(rows: list[dict[str, Any]], spans: list[RequestSpan], budget: int | None = None,
                 chunk_cap: int | None = None) -> list[str]:
    """Sentences about RUN (validated rows, their spans); BUDGET: max_num_batched_tokens when known; CHUNK_CAP: the
    engine's long_prefill_token_threshold when known (0 or None: no per-prompt cap)."""
    if not rows or not spans:
        return []
    done = {s.id: prompt_done_step(s) for s in spans}
    by_step: dict[int, list[str]] = defaultdict(list)
    for s in spans:
        if done[s.id] is not None:
            by_step[done[s.id]].append(s.id)
    first = rows[0]["step"]
    together = len({s.arrived_step for s in spans}) == 1
    lines = []
    if together and set(by_step) == {first} and not any(s.preemptions for s in spans):
        tokens = rows[0]["num_tokens"]
        within = f" (within the budget of {budget})" if budget else ""
        lines.append(f"Step {first} prefilled every prompt, {tokens} tokens{within}, and sampled each request's first "
                     f"token, so a request of g tokens finished at step {first} + g - 1 = g"
                     + ("" if first == 1 else f" + {first - 1}") + ".")
        return lines
    parts = []
    for step in sorted(by_step):
        ids = by_step[step]
        parts.append(f"step {step}: {_names(ids)}")
    lines.append("Prompts completed at " + "; ".join(parts) + ".")
    lines += _why_waited(rows, spans, done, budget)
    chunked = [s for s in spans if s.prefill_steps > 1 and not s.preemptions]
    if chunked:
        cap = f", and a prompt gets at most {chunk_cap} tokens a step" if chunk_cap else ""
        lines.append(f"Prefilled in chunks (the step budget{f' of {budget}' if budget else ''} is shared{cap}): "
                     + "; ".join(f"{label_of(s.id)} in {s.prefill_steps} steps" for s in chunked[:4])
                     + ("; …" if len(chunked) > 4 else "") + ".")
    lines.append(_finish_rule(spans, done))
    return lines


def _why_waited(rows: list[dict[str, Any]], spans: list[RequestSpan], done: dict[str, int | None],
                budget: int | None) -> list[str]:
    """Why requests were not scheduled on the step they arrived: the prefix another request was computing (the
    rows' "held" list when the engine reports it; else inferred: it then read prompt tokens from the prefix cache
    while another request was prefilling), or the step's budget / sequence limit / free blocks."""
    row_at = {r["step"]: r for r in rows}
    held, queued = [], []
    for s in spans:
        if s.first_step is None or s.first_step == s.arrived_step:
            continue
        waited = s.first_step - s.arrived_step
        others = [q["id"] for q in row_at[s.arrived_step]["requests"] if q["phase"] == PREFILL and q["id"] != s.id]
        reported = any(s.id in row_at[step].get("held", ()) for step in range(s.arrived_step, s.first_step)
                       if step in row_at)
        if reported or (s.cached > 0 and others and not any(r.get("held") for r in rows)):
            held.append((s, waited, others))
        else:
            queued.append((s, waited))
    lines = []
    if held:
        computing = sorted({rid for _, _, others in held for rid in others})
        ids = [s.id for s, _, _ in held]
        tokens = sorted({s.cached for s, _, _ in held})
        lines.append(
            f"{_count(len(ids), 'request')} ({_names(ids)}) waited "
            + (f"{held[0][1]} step{'s' if held[0][1] != 1 else ''}" if len({w for _, w, _ in held}) == 1 else "a few steps")
            + f" for the prompt prefix {_names(computing) or 'another request'} was computing"
            + (f" (the first {' / '.join(map(str, tokens))} tokens of their prompts are the same)" if any(tokens) else "")
            + ", then read it from the prefix cache instead of computing it again.")
    if queued:
        ids = [s.id for s, _ in queued]
        lines.append(f"{_count(len(ids), 'request')} ({_names(ids)}) waited in the queue: the step's token budget"
                     f"{f' ({budget})' if budget else ''}, max_num_seqs or free KV blocks were used up.")
    return lines


def _finish_rule(spans: list[RequestSpan], done: dict[str, int | None]) -> str:
    """The rule, checked on every request: examples that follow it, and the ones that did not (preempted)."""
    follows, late = [], []
    for s in spans:
        if s.finished_step is None or done[s.id] is None:
            continue
        expected = done[s.id] + s.output_len - 1
        (follows if s.finished_step == expected and not s.preemptions else late).append((s, expected))
    text = "Each request then finished g - 1 steps after the step that completed its prompt (that step samples its " \
           "first token)"
    if follows:
        examples = sorted(follows, key=lambda item: (done[item[0].id], item[0].finished_step))
        picks = [item for i, item in enumerate(examples)  # the first of each completion step, up to three
                 if i == 0 or done[item[0].id] != done[examples[i - 1][0].id]][:3]
        text += ": " + ", ".join(f"{label_of(s.id)} completed at step {done[s.id]} with g = {s.output_len} → step "
                                 f"{s.finished_step}" for s, _ in picks)
    if late:
        text += "; later than that, because preempted and recomputed: " + ", ".join(
            f"{label_of(s.id)} (step {s.finished_step}, not {expected})" for s, expected in late[:4])
    return text + "."
