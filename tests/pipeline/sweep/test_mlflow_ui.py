"""The MLflow UI, seen in a real browser: headless Debian Chromium, driven through chromedriver by Selenium, on the
session's `mlflow server` after the mixer sweep (`mixer_sweep`, conftest.py) ran: the sweep's parent run with its
two child runs nested under it, their compare view, and each child's loss-by-position plot and passkey heatmap.

    .venv/bin/python -m pytest -q tests/pipeline/sweep/test_mlflow_ui.py
    LONGTRAIN_UI_SCREENSHOTS=/tmp/shots .venv/bin/python -m pytest -q tests/pipeline/sweep/test_mlflow_ui.py

The browser comes from Debian (`apt-get install chromium chromium-driver`, which `.ci/browser.sh` does where apt
exists); without it the test skips and says so. Chromium starts with a fresh profile and every background service off
(no network but 127.0.0.1 is reachable here). Screenshots go to $LONGTRAIN_UI_SCREENSHOTS when set (the ones in
docs/images/ came from there), else to the test's temporary directory.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from urllib.parse import quote
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,820")
WAIT_S = 120  # the UI's first load compiles nothing, but a loaded 2-core machine renders slowly


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: `apt-get install chromium chromium-driver` "
                    "(.ci/browser.sh does it where apt-get exists)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + (f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


class Page:
    """The browser on one MLflow server: open a UI route, wait for what it must show, take a screenshot."""

    def __init__(self, driver, uri: str, shots: Path):
        self.driver, self.uri, self.shots = driver, uri, shots

    def text(self) -> str:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.TAG_NAME, "body").text

    def wait(self, condition, what: str) -> None:
        from selenium.common.exceptions import TimeoutException
        from selenium.webdriver.support.ui import WebDriverWait

        try:
            WebDriverWait(self.driver, WAIT_S, poll_frequency=0.5).until(lambda _: condition())
        except TimeoutException:
            self.shot("timeout")
            text = self.text()
            pytest.fail(f"the MLflow UI did not show {what} within {WAIT_S} s; page text (its end):\n{text[-3000:]}")

    def open(self, route: str, *texts: str) -> None:
        # A fresh load of the app: a change of the hash alone keeps the page's state (the artifact viewer goes on
        # showing the file it showed)
        self.driver.get("about:blank")
        self.driver.get(f"{self.uri}/#/{route}")
        self.wait(lambda: all(t in self.text() for t in texts), f"{texts} at #/{route}")
        self.close_assistant()

    def close_assistant(self) -> None:
        """MLflow 3's assistant pane opens beside the page in a fresh profile; it hides half of the table."""
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.common.by import By

        for button in self.driver.find_elements(By.XPATH, "//button[@aria-label='Close']"):
            try:
                button.click()
            except WebDriverException:
                pass

    def image_width(self) -> int:
        """The largest natural width among the page's loaded images (0 when none has loaded)."""
        return int(self.driver.execute_script(
            "return Math.max(0, ...Array.from(document.images).map(i => i.complete ? i.naturalWidth : 0))"))

    def shot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path


def png_width(path: Path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">I", data[16:20])[0]


def test_mlflow_ui_shows_the_sweep_its_comparison_and_the_long_context_pictures(mixer_sweep, browser, tmp_path):
    from mlflow.tracking import MlflowClient
    from selenium.webdriver.common.by import By

    from pipeline.tracking.names import PARENT_RUN_TAG

    shots = Path(os.environ.get("LONGTRAIN_UI_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=mixer_sweep.uri)
    exp = client.get_experiment_by_name(mixer_sweep.experiment)
    parent = client.search_runs([exp.experiment_id], "attributes.run_name = 'mixers'")[0]
    children = client.search_runs([exp.experiment_id], f"tags.`{PARENT_RUN_TAG}` = '{parent.info.run_id}'")
    names = sorted(c.info.run_name for c in children)
    page = Page(browser, mixer_sweep.uri, shots)

    # The runs table: the sweep's parent run, opened as model training (not the GenAI overview), with its two
    # trials nested under it once expanded.
    page.open(f"experiments/{exp.experiment_id}/runs", "mixers", "Run Name")
    assert not any(n in page.text() for n in names)  # nested: hidden until the parent is expanded
    browser.find_element(By.XPATH, "//div[@role='gridcell'][.//span[text()='mixers']]//button").click()
    page.wait(lambda: all(n in page.text() for n in names), f"the child runs {names} under the parent")
    page.shot("mlflow_sweep_runs")

    # The compare view of the two trials: their names and the parameter that differs
    ids = [c.info.run_id for c in children]
    experiments = json.dumps([exp.experiment_id])
    page.open(f"compare-runs?runs={json.dumps(ids)}&experiments={experiments}",
              *names, "model.mixer", "attention", "resonance")
    page.shot("mlflow_compare")
    # ... and the sweep's metric plotted for both (the compare view's metric table is virtualized: with the
    # per-position metrics val/loss is off screen there). The route is the one the UI's metric links build.
    assert all("val/loss" in c.data.metrics for c in children), [sorted(c.data.metrics) for c in children]
    key, keys = quote(json.dumps("val/loss"), safe=""), quote(json.dumps(["val/loss"]), safe="")
    page.open(f"metric?runs={json.dumps(ids)}&metric={key}&experiments={experiments}&plot_metric_keys={keys}"
              "&plot_layout={}&x_axis=step&y_axis_scale=linear&line_smoothness=1&show_point=false"
              "&deselected_curves=[]&last_linear_y_axis_range=[]", *names, "val/loss", "Latest")
    page.shot("mlflow_val_loss")

    # Each trial's pictures, rendered at their full size in the artifact viewer
    for child in children:
        mixer = child.data.params["model.mixer"]
        for artifact in ("position_loss.png", "passkey_heatmap.png"):
            width = png_width(Path(client.download_artifacts(child.info.run_id, artifact, str(tmp_path / mixer))))
            page.open(f"experiments/{exp.experiment_id}/runs/{child.info.run_id}/artifacts/{artifact}", artifact)
            page.wait(lambda: page.image_width() == width, f"{artifact} of {child.info.run_name} ({width} px wide)")
            page.shot(f"mlflow_{artifact[:-4]}_{mixer}")
