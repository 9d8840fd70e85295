"""The report's "held-out replies": for a few evaluations along a run, the first held-out prompts with the model's
replies and their verdicts, as text a person reads at a glance (a run that games its verifier shows here even when
its accuracy reads well). The actor records them in each `eval` event (`replies`, actor.eval_samples of them).
Everything from the run is HTML-escaped: replies are model output."""

from __future__ import annotations

import html
from typing import Any

SHOWN_EVALS = 4  # the first, the last and evenly spaced ones between


def pick(evals: list[dict], k: int = SHOWN_EVALS) -> list[dict]:
    """Up to k evaluations, first and last included, evenly spaced."""
    if len(evals) <= k:
        return list(evals)
    idx = sorted({round(i * (len(evals) - 1) / (k - 1)) for i in range(k)})
    return [evals[i] for i in idx]


def visible(text: str) -> str:
    """The reply as the model wrote it, with its line breaks and tabs marked (↵, ⇥) and other control characters
    written as escapes, so trailing junk and whitespace show."""
    marks = {"\n": "↵\n", "\t": "⇥"}
    return "".join(marks.get(ch, ch if ch.isprintable() or ch == " " else repr(ch)[1:-1]) for ch in text)


def _finish(finish: str) -> str:
    return {"stop": "ended (EOS)", "length": "cut off (max_new_tokens)"}.get(finish, finish)


def _row(r: dict[str, Any]) -> str:
    cls = "correct" if r.get("label") == "correct" else "cut" if r.get("finish") == "length" else ""
    cells = [f"<td class='reply'>{html.escape(str(r.get('prompt', '')))}</td>",
             f"<td class='reply'>{html.escape(visible(str(r.get('reply', ''))))}</td>",
             f"<td>{html.escape(str(r.get('tokens', '')))}</td>",
             f"<td>{html.escape(_finish(str(r.get('finish', ''))))}</td>",
             f"<td>{html.escape(str(r.get('label', '')))}</td>"]
    return f"<tr class='{cls}'>{''.join(cells)}</tr>"


def replies_html(run: Any) -> str:
    """The section for one run (a report.Run); a note instead when its evaluations recorded no replies."""
    evals = [r for r in run.events("eval") if r.get("replies")]
    title = f"<h2>Held-out replies: {html.escape(run.name)}</h2>"
    if not evals:
        return title + "<p>No replies recorded (actor.eval_samples = 0, or a run from before they were).</p>"
    parts = [title, "<p>The first held-out problems at a few evaluations, each reply as the model wrote it (line "
                    "breaks and tabs marked ↵ ⇥); a reply counts only when it ended with the end-of-sequence "
                    "token.</p>"]
    head = "<tr><th>prompt</th><th>reply</th><th>tokens</th><th>ending</th><th>verdict</th></tr>"
    for ev in pick(evals):
        acc = ev.get("accuracy", ev.get("pass@1"))
        what = [f"trainer version {ev.get('trainer_version', ev.get('step', '?'))}"]
        if acc is not None:
            what.append(f"held-out accuracy {100 * float(acc):.1f}%")
        if ev.get("truncated_frac") is not None:
            what.append(f"{100 * float(ev['truncated_frac']):.0f}% of replies cut off")
        parts.append(f"<h3>{html.escape(', '.join(what))}</h3>")
        parts.append(f"<table>{head}{''.join(_row(r) for r in ev['replies'])}</table>")
    return "".join(parts)
