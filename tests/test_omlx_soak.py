"""oMLX 0.3.8 serving MTP under load and faults (opt-in: OMLX_SOAK=1, with OMLX_SRC).

16 clients send mixed requests (``omlx_mtp.tools.soak.plan``: streaming or not, greedy and sampled,
penalties, grammars, stop strings, prompts of 10 to 4,000 tokens, hang-ups) to the model with MTP
at a fixed depth of 3, to the same model with MTP as shipped (``auto``) and, before and after them,
to the model without MTP: 300 to the demo pair (oMLX's LLM engine), 96 to the multimodal demo, a
third with an image (its VLM engine).  Greedy answers are checked against MTP
off's.  Held: no 5xx, no traceback in the server log, no greedy mismatch, no grammar answer outside
its grammar, exact max_tokens cuts, repeats answered alike, resident memory flat after warm-up.
The figures are printed (and written to OMLX_SOAK_REPORT.<model>.json if set).  About 12 and 6
minutes on 2 cores with OpenBLAS preloaded."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest

from omlx_mtp.tools import soak

from .test_omlx_serve import SERVES, demo_models, omlx_server
from .test_omlx_serve_grammar import grammar_allows

pytest.importorskip("xgrammar")
pytestmark = SERVES + [pytest.mark.skipif(os.environ.get("OMLX_SOAK") != "1",
                                          reason="the soak test runs with OMLX_SOAK=1 (about 15 minutes; faster with OpenBLAS preloaded)")]
REQUESTS, VLM_REQUESTS, CLIENTS = 300, 96, 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    tree, models, base = demo_models(root)
    auto = shipped(models, base, "demo-mtp", "demo-plain")
    with omlx_server(tree, models, base, root / "server.log") as (url, pid):
        yield url, pid, root, ["demo-mtp", auto]


def shipped(models, base, mtp_model: str, plain_model: str) -> str:
    """A copy of ``mtp_model`` with MTP as shipped (``mtp_enabled: true``, every other setting its
    default: depth ``auto``), and a second copy of ``plain_model`` (its prefix cache cold for the run
    after the MTP runs); the first one's name."""
    name = f"{mtp_model}-auto"
    shutil.copytree(models / mtp_model, models / name)
    (base / "model_settings" / f"{name}.yaml").write_text("mtp_enabled: true\n")
    shutil.copytree(models / plain_model, models / f"{plain_model}-again")
    return name


def soak_report(url: str, pid: int, root, plain_model: str, mtp_models: list[str], jobs: list) -> dict:
    """Every model's run, the references and the figures (``report[model]["problems"]`` empty where
    MTP held).  MTP off runs first and, from a copy whose prefix cache is as cold, again last; each
    MTP model's throughput is taken over the mean of those two (the machine's drift between them is
    reported as ``plain_drift``)."""
    for model in (plain_model, *mtp_models, f"{plain_model}-again"):  # warm-up: loads, first traces
        for job in jobs[:4]:
            soak.send(url, model, dataclasses.replace(job, fault=None))
    plain = soak.run(url, plain_model, jobs, clients=CLIENTS, pid=pid)
    runs = {model: soak.run(url, model, jobs, clients=CLIENTS, pid=pid) for model in mtp_models}
    plain_again = soak.run(url, f"{plain_model}-again", jobs, clients=CLIENTS, pid=pid)  # its prefix cache cold too
    # Greedy references: MTP off under the same load; for grammar requests MTP off one at a time
    # (oMLX 0.3.8's own batched grammar path drops the constraint under load), sent last so the
    # prefix cache is as warm as it was for the loaded runs.  Even so oMLX 0.3.8 without MTP
    # sometimes leaves the grammar (unpatched too): such an answer can't be the reference.
    alone = soak.one_at_a_time(url, plain_model, [j for j in jobs if j.extra])
    broken = [i for i, r in alone.items() if not grammar_allows(jobs[i].extra, r.text)]
    expected = {r.index: r for r in plain.results if not jobs[r.index].extra} | {
        i: r for i, r in alone.items() if i not in broken}
    soak.dump(root / f"soak-{mtp_models[0]}.json", jobs,
              {"plain": plain.results, **{m: r.results for m, r in runs.items()}, "alone": list(alone.values())})
    report = {model: soak.check(jobs, run, expected) for model, run in runs.items()}
    report["plain"] = {k: v for k, v in soak.check(jobs, plain, expected).items() if k != "problems"}
    grammar = [j for j in jobs if j.extra and j.fault is None]
    for name, run in (*runs.items(), ("plain", plain)):
        results = {r.index: r for r in run.results}
        report[name]["grammar_answers_outside_grammar"] = sum(not grammar_allows(j.extra, results[j.index].text)
                                                              for j in grammar)
    report["plain_one_at_a_time_outside_grammar"] = len(broken)
    report["image_requests"] = sum(bool(j.images) for j in jobs)
    off = (plain.tokens_per_second + plain_again.tokens_per_second) / 2
    report["plain_drift"] = round(plain_again.tokens_per_second / plain.tokens_per_second, 2)
    for model, run in runs.items():
        report[model]["throughput_ratio"] = round(run.tokens_per_second / off, 2)
    log = (root / "server.log").read_text()
    report["mtp_requests_logged"] = log.count("omlx-mtp: request uid")
    report["host_restarts_logged"] = log.count("requests for re-prefill")
    report["regime"] = "CPU, " + ("OpenBLAS" if "openblas" in os.environ.get("LD_PRELOAD", "") else "bundled BLAS")
    print(json.dumps(report, indent=1))
    if os.environ.get("OMLX_SOAK_REPORT"):
        with open(f"{os.environ['OMLX_SOAK_REPORT']}.{mtp_models[0]}.json", "w") as f:
            json.dump(report, f, indent=1)
    assert "Traceback" not in log, log[log.index("Traceback") - 2000 : log.index("Traceback") + 3000]
    return report


def assert_held(report: dict, models: list[str], requests: int) -> None:
    for model in models:
        got = report[model]
        assert got["problems"] == [], (model, got["problems"][:20])
        if got["streams_restarted_by_host"]:  # only where oMLX logged that it restarted requests
            assert report["host_restarts_logged"] > 0
        assert got["grammar_answers_outside_grammar"] == 0, model
        assert got["greedy_compared"] >= 0.7 * requests and got["faults_injected"] >= 0.03 * requests
        warm = got["rss_after_warm_up_mb"]
        assert got["rss_growth_mb"] < max(0.1 * warm, 64), (model, got)
    assert report["mtp_requests_logged"] >= 0.8 * requests * len(models)  # the MTP models decoded with MTP


def test_soak(server):
    url, pid, root, mtp_models = server
    report = soak_report(url, pid, root, "demo-plain", mtp_models, soak.plan(REQUESTS, seed=7))
    assert_held(report, mtp_models, REQUESTS)


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    pytest.importorskip("mlx_vlm")
    from .test_omlx_serve_vlm import vlm_models

    root = tmp_path_factory.mktemp("soak-vlm")
    tree, models, base = vlm_models(root)
    auto = shipped(models, base, "demo-vlm-mtp", "demo-vlm-plain")
    with omlx_server(tree, models, base, root / "server.log") as (url, pid):
        yield url, pid, root, ["demo-vlm-mtp", auto]


def test_soak_multimodal(vlm_server):
    """The multimodal demo through oMLX's VLM engine: a third of the requests carry an image."""
    from .test_omlx_serve_vlm import image_part

    url, pid, root, mtp_models = vlm_server
    images = [image_part(seed)["image_url"]["url"] for seed in range(4)]
    jobs = soak.plan(VLM_REQUESTS, seed=11, images=images)
    assert_held(soak_report(url, pid, root, "demo-vlm-plain", mtp_models, jobs), mtp_models, VLM_REQUESTS)
