"""lm-evaluation-harness against `inflight serve`: a local JSONL multiple-choice task (loglikelihood requests:
`echo` + `logprobs`) and a generate_until task, run by `lm_eval --model local-completions`, give the same accuracy
as lm-eval's own `hf` model on the same checkpoint, and the same per-choice loglikelihoods within 1e-3.

lm_eval runs from its own test-only venv (scripts/lmeval-env.sh, `make test-lmeval`); without it these tests skip.
Set INFLIGHT_LMEVAL_PYTHON to another interpreter that has lm_eval. Everything runs offline: the tasks read local
JSONL files, the tokenizer is the checkpoint's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.servers import model_of, serve_model

REPO = Path(__file__).resolve().parents[2]
LMEVAL_PY = Path(os.environ.get("INFLIGHT_LMEVAL_PYTHON", REPO / ".cache" / "lmeval-venv" / "bin" / "python"))
pytestmark = pytest.mark.skipif(not LMEVAL_PY.exists(), reason=(
    f"no lm-eval test venv at {LMEVAL_PY}: build it with `make test-lmeval` (scripts/lmeval-env.sh) or set "
    "INFLIGHT_LMEVAL_PYTHON"))

MC_YAML = """task: inflight_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_YAML = """task: inflight_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "1+1=2\\n2+3=5\\n4+4=8\\n{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def write_tasks(root: Path) -> Path:
    """Two tasks over local JSONL files: arithmetic with four answers, and the same questions to complete."""
    mc, gen = [], []
    for i in range(24):
        a, b = 2 + i % 7, 3 + (i * 5) % 11
        right = a + b
        choices = [f" {right + d}" for d in (0, 1, -1, 10)]
        shift = i % 4  # the right answer in every position
        choices = choices[shift:] + choices[:shift]
        mc.append({"question": f"{a}+{b}=?", "choices": choices, "label": choices.index(f" {right}")})
        gen.append({"question": f"{a}+{b}=", "answer": f"{right}"})
    tasks = root / "tasks"
    tasks.mkdir()
    for name, rows, yaml in (("mc", mc, MC_YAML), ("gen", gen, GEN_YAML)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"{name}.yaml").write_text(yaml.format(data=data))
    return tasks


def lm_eval(root: Path, tasks: Path, name: str, model: str, model_args: str) -> dict:
    """One `lm_eval` run (both tasks, samples logged) in the test venv, offline; its results JSON."""
    out = root / name
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(root / "hf-datasets"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # the harness's venv, not the worktree under test (the server runs that)
    cmd = [str(LMEVAL_PY), "-m", "lm_eval", "--model", model, "--model_args", model_args,
           "--tasks", "inflight_mc,inflight_gen", "--include_path", str(tasks), "--batch_size", "1", "--device", "cpu",
           "--output_path", str(out), "--log_samples"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, f"lm_eval {model} failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    results = sorted(out.rglob("results_*.json"))
    assert results, f"no results under {out}: {run.stderr[-3000:]}"
    body = json.loads(results[-1].read_text())
    body["samples"] = {}
    for task in ("inflight_mc", "inflight_gen"):
        path = sorted(out.rglob(f"samples_{task}_*.jsonl"))[-1]
        body["samples"][task] = [json.loads(line) for line in path.read_text().splitlines()]
    return body


def per_choice_loglikelihoods(samples: list[dict]) -> list[float]:
    return [float(r[0][0]) for s in sorted(samples, key=lambda s: s["doc_id"]) for r in s["resps"]]


@pytest.mark.parametrize("checkpoint", [
    "tiny_model_dir",  # random weights, character tokenizer: ~1.5 min
    pytest.param("smollm2_dir", marks=pytest.mark.slow),  # a real model and BPE tokenizer: a few minutes
])
def test_lm_eval_local_completions_matches_its_hf_model(checkpoint, tmp_path, request):
    tiny_model_dir = request.getfixturevalue(checkpoint)
    tasks = write_tasks(tmp_path)
    with serve_model(tiny_model_dir) as server:
        served = lm_eval(tmp_path, tasks, "inflight", "local-completions",
                         f"model={model_of(server.url)},base_url={server.url}/v1/completions,"
                         f"tokenizer_backend=huggingface,tokenizer={tiny_model_dir},num_concurrent=1,max_retries=1")
    hf = lm_eval(tmp_path, tasks, "hf", "hf", f"pretrained={tiny_model_dir},dtype=float32")
    for task, metric in (("inflight_mc", "acc,none"), ("inflight_mc", "acc_norm,none"),
                         ("inflight_gen", "exact_match,none")):
        assert served["results"][task][metric] == hf["results"][task][metric], (task, metric)
    got = per_choice_loglikelihoods(served["samples"]["inflight_mc"])
    want = per_choice_loglikelihoods(hf["samples"]["inflight_mc"])
    assert len(got) == len(want) == 24 * 4
    diff = max(abs(a - b) for a, b in zip(got, want))
    print(f"lm-eval {checkpoint} inflight_mc acc: inflight {served['results']['inflight_mc']['acc,none']}, "
          f"hf {hf['results']['inflight_mc']['acc,none']}; max per-choice loglikelihood diff {diff:.2e}; "
          f"inflight_gen exact_match {served['results']['inflight_gen']['exact_match,none']}")
    assert diff < 1e-3
    gen_served = [s["resps"][0][0] for s in sorted(served["samples"]["inflight_gen"], key=lambda s: s["doc_id"])]
    gen_hf = [s["resps"][0][0] for s in sorted(hf["samples"]["inflight_gen"], key=lambda s: s["doc_id"])]
    assert gen_served == gen_hf  # greedy: the same completions, cut at the same stop
