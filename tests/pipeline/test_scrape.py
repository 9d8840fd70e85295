"""The launcher's /metrics scrape against a real `inflight serve`: counters logged as they are, rates from two
scrapes."""

from __future__ import annotations

import httpx

from inflight.engine.serve import ServerProcess
from inflight.pipeline.scrape import ServerScraper


class Log:
    def __init__(self):
        self.records = []

    def log(self, event, **rec):
        self.records.append((event, rec))


def test_scrape_logs_the_engine_s_counters(tiny_model_dir):
    with ServerProcess(str(tiny_model_dir), extra_args=["--max-model-len", "128"]) as server:
        log = Log()
        scraper = ServerScraper([server.url], log)
        try:
            model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
            first = scraper.scrape()[0]
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": model, "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 4, "ignore_eos": True,
                                 "n": 2})
            r.raise_for_status()
            second = scraper.scrape()[0]
        finally:
            scraper.close()
    assert [e for e, _ in log.records] == ["server_metrics", "server_metrics"]
    assert second["generated_tokens_total"] - first["generated_tokens_total"] == 8  # 2 choices x 4 tokens
    # the prompt prefilled once for both choices; at least 4 steps run (the first token comes with the prefill)
    assert second["prefill_tokens_total"] - first["prefill_tokens_total"] == 6
    assert second["engine_steps_total"] - first["engine_steps_total"] >= 3
    assert second["tokens_per_s"] > 0
