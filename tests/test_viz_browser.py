"""`mgraph view` in a real browser: headless Chromium (Debian's chromium + chromium-driver, which
.ci/run installs) opens the page offline; no console errors, the expected numbers of nodes, edges
and lanes render, clicking a task shows its details, and screenshots are saved (to
$MGRAPH_SCREENSHOTS when set: that is how docs/img/view_*.png are made).

Skips, saying why, only where chromium is absent and CI is unset; under CI it must run."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

import mgraph as mg
from mgraph.viz import view
from mgraph.viz.data import LINKS, stage_of, task_edges

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        reason = "headless chromium not installed (apt-get install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}: CI must run the browser test (.ci/run installs them)")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1600,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingOptions", {"browser": "ALL"})
    # explicit driver path: selenium's own manager would try to download a browser
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def shot(driver, tmp_path: Path, name: str) -> Path:
    out = Path(os.environ.get("MGRAPH_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    assert driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    return path


def count(driver, css: str) -> int:
    return int(driver.execute_script(f"return document.querySelectorAll('{css}').length"))


def errors(driver) -> list:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def open_page(driver, path: Path) -> None:
    driver.get(path.resolve().as_uri())
    assert errors(driver) == []


def click(driver, css: str) -> None:
    driver.find_element("css selector", css).click()


def test_small_graph_schedule_and_timeline(browser, tmp_path):
    g = mg.ops.gemm_allreduce(M=256, N=256, K=128, topology="2x2", dtype=torch.float32,
                              tile=[64, 64])
    sched = mg.schedule(g)
    result = mg.run(sched)
    page = view(result, tmp_path / "small.html", schedule=sched)
    open_page(browser, page)
    # op level: one box per (stage, rank), one edge per (box, box, link class)
    box = {t.id: (stage_of(t.name), t.rank) for t in g.tasks}
    edges = task_edges(g)
    merged = {(box[a], box[b], link) for a, b, link, _ in edges if box[a] != box[b]}
    assert count(browser, "#lanes .lane") == g.topology.world_size
    assert count(browser, "#nodes .node") == len(set(box.values()))
    assert count(browser, "#edges .edge") == len(merged)
    for link in LINKS:
        want = sum(1 for m in merged if m[2] == link)
        assert count(browser, f'#edges .edge[data-link="{link}"]') == want > 0
    shot(browser, tmp_path, "view_graph")
    # lanes per role
    browser.execute_script("const s = document.getElementById('lane-by'); s.value = 'role';"
                           "s.dispatchEvent(new Event('change'))")
    assert count(browser, "#lanes .lane") == len({t.role for t in g.tasks})
    browser.execute_script("const s = document.getElementById('lane-by'); s.value = 'rank';"
                           "s.dispatchEvent(new Event('change'))")
    # tiles: every task its own node, every dependency its own edge
    click(browser, "#expand-all")
    assert count(browser, "#nodes .node.tile") == len(g.tasks)
    assert count(browser, "#edges .edge") == len({(a, b, link) for a, b, link, _ in edges})
    task = next(t for t in g.tasks if t.role == "rdma")
    click(browser, f'.node.tile[data-task="{task.id}"]')
    details = browser.find_element("id", "details").text
    assert browser.find_element("id", "detail-name").text == task.name
    assert str(task.writes[0]) in details and "waits (1)" in details and "cost (model)" in details
    assert count(browser, ".node.selected") == 1 and count(browser, ".edge.hot") >= 2
    shot(browser, tmp_path, "view_tiles")
    # a task named in the details opens its own details
    click(browser, "#details a.task")
    assert browser.find_element("id", "detail-name").text != task.name
    click(browser, "button[data-tab=schedule]")
    queues = sum(1 for rs in sched.ranks for q in rs.queues.values() if q)
    assert count(browser, "canvas.queue") == queues
    assert count(browser, ".smbar") == len(sched.ranks)
    shot(browser, tmp_path, "view_schedule")
    click(browser, "button[data-tab=timeline]")
    canvas = browser.find_element("id", "tl-canvas")
    recs = result.trace.records
    assert int(canvas.get_attribute("data-lanes")) == len({(r.rank, r.role, r.worker) for r in recs})
    assert int(canvas.get_attribute("data-drawn")) == len(recs)
    shot(browser, tmp_path, "view_timeline")
    assert errors(browser) == []


def test_forty_thousand_tasks_stay_usable(browser, tmp_path):
    g = mg.ops.gemm_allreduce(M=8192, N=8192, K=4096, topology="2x8", dtype=torch.bfloat16)
    sched = mg.schedule(g)
    from test_viz import queue_trace

    page = view(sched, tmp_path / "big.html", trace=queue_trace(sched))
    start = time.perf_counter()
    open_page(browser, page)
    assert time.perf_counter() - start < 30
    stages = {stage_of(t.name) for t in g.tasks}
    assert count(browser, "#lanes .lane") == 16
    assert count(browser, "#nodes .node") == 16 * len(stages)  # aggregated until zoomed
    click(browser, "#nodes .node.agg")
    assert "expand" in browser.find_element("id", "details").text
    click(browser, "#details button[data-expand]")
    tiles = count(browser, "#nodes .node.tile")
    assert 16 * 16 <= tiles <= 6000  # the first tiles of one op on every rank, within budget
    shot(browser, tmp_path, "view_big_expanded")
    click(browser, "button[data-tab=timeline]")
    assert int(browser.find_element("id", "tl-canvas").get_attribute("data-lanes")) == 16 * 3
    shot(browser, tmp_path, "view_big_timeline")
    assert errors(browser) == []
