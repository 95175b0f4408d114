"""The web page of ``edgevlm serve`` in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by Selenium) against a real server on 127.0.0.1. Skipped when no
browser is installed; ``.ci/run`` installs one and sets ``EDGEVLM_REQUIRE=page``, so there they
fail instead. Screenshots go to ``test-artifacts/``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from .conftest import make_image, skip_unless_required
from .test_serve import Served

ARTIFACTS = Path(os.environ.get("EDGEVLM_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))
KEY = "page-test-key"


def _browser_paths() -> tuple[str, str] | None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


@pytest.fixture(scope="module")
def browser():
    paths = _browser_paths()
    if paths is None:
        skip_unless_required("page", "no Chromium with chromedriver here (apt-get install chromium chromium-driver)")
    try:
        from selenium import webdriver
    except ImportError:
        skip_unless_required("page", "no Selenium here (the test extra)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = paths[0]
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        "--no-first-run",
        "--disable-extensions",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=paths[1]), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def site(model_pair):
    """LLaVA-1.5-7B layer shapes (2 layers): ~10 ms per token, so a reply can be stopped midway."""
    s = Served(model_pair("llava15", "real"), "--parallel", "2", "--ctx", "4096", "--api-key", KEY)
    yield s
    assert "Traceback" not in s.stop()


def shot(driver, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def wait(driver, condition, timeout: float = 60, what: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))
    except Exception:
        shot(driver, "failed-" + (what or "wait").replace(" ", "-"))
        raise AssertionError(f"timed out waiting for {what}") from None


def by_id(driver, name):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, name)


def css(driver, selector):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def served(site) -> int:
    return site.status()["requests"]["served"]


@pytest.mark.slow
@pytest.mark.timeout(210)  # 70 s measured on 2 cores shared with 3 other suites
def test_the_page_chats_about_a_picture_and_shows_the_plan(browser, site, tmp_path):
    from selenium.webdriver.common.keys import Keys

    d = browser
    d.get(site.url + "/")
    # the key is asked once, kept in the tab
    dialog = wait(d, lambda d: by_id(d, "key-dialog").get_attribute("open") is not None, what="key dialog")
    assert dialog
    by_id(d, "key").send_keys(KEY + Keys.ENTER)
    wait(d, lambda d: by_id(d, "model").text == "model", what="model name")
    wait(d, lambda d: "sequences busy" in by_id(d, "server").text and css(d, "#devices .bar"), what="panel")
    assert "CPU" in by_id(d, "devices").text and "0 / 2" in by_id(d, "server").text

    # a picture: before sending, what it will cost, drawn on a thumbnail
    pic = make_image(tmp_path / "house.png", 640, 480, seed=5, mode="gradient")
    by_id(d, "file").send_keys(str(pic))
    wait(d, lambda d: "576 tokens" in by_id(d, "attachments").text, what="picture cost")
    assert css(d, "#attachments canvas")
    shot(d, "attached")

    box = by_id(d, "input")
    box.send_keys("What is in")
    box.send_keys(Keys.SHIFT + Keys.ENTER)  # a new line, not sent
    box.send_keys("this picture?")
    assert box.get_attribute("value") == "What is in\nthis picture?" and not css(d, ".msg.user")
    before = served(site)
    box.send_keys(Keys.ENTER)
    wait(d, lambda d: css(d, ".msg.user img"), what="the picture in the conversation")
    # streamed text arrives: it grows while the reply is in flight
    first = wait(d, lambda d: (t := "".join(e.text for e in css(d, ".msg.assistant .text"))) and t, what="text")
    wait(d, lambda d: css(d, ".msg.assistant .meta"), timeout=120, what="the reply's end")
    full = css(d, ".msg.assistant .text")[0].text
    assert len(full) >= len(first) and full
    meta = css(d, ".msg.assistant .meta")[0].text
    assert "prompt" in meta and "cached" in meta and "reply" in meta
    wait(d, lambda d: "context" in by_id(d, "ctx").text, what="context use")
    wait(d, lambda d: f"{before + 1} served" in by_id(d, "server").text, what="panel update")
    shot(d, "answered")

    # a follow-up reuses the cache; stop a long reply midway
    by_id(d, "max-tokens").clear()
    by_id(d, "max-tokens").send_keys("2000")
    box.send_keys("Tell me a long story." + Keys.ENTER)
    wait(
        d,
        lambda d: len(css(d, ".msg.assistant")) == 2 and len(css(d, ".msg.assistant .text")[1].text) > 3,
        what="the long reply",
    )
    by_id(d, "stop").click()
    wait(d, lambda d: len(css(d, ".msg.assistant .meta")) == 2, what="stopped")
    meta = css(d, ".msg.assistant .meta")[1].text
    assert "stopped" in meta
    site.wait_idle(timeout=10)  # the server freed the sequence
    assert site.status()["requests"]["cancelled"] >= 1

    # a file that is not a picture: the server's own message
    bad = tmp_path / "notes.png"
    bad.write_text("a shopping list")
    by_id(d, "file").send_keys(str(bad))
    wait(d, lambda d: "not an image" in by_id(d, "attachments").text, what="the server's error")
    shot(d, "bad-file")

    # a narrow window: everything still there, one column
    d.set_window_size(420, 900)
    assert by_id(d, "send").is_displayed() and by_id(d, "input").is_displayed()
    shot(d, "narrow")
    d.set_window_size(1280, 900)

    # new conversation
    by_id(d, "new-chat").click()
    assert not css(d, ".msg") and "New conversation" in by_id(d, "log").text


def test_the_page_is_served_from_the_package(site):
    page = httpx.get(site.url + "/")
    assert page.status_code == 200 and "<title>edgevlm</title>" in page.text
    for name in ("app.js", "style.css"):
        r = httpx.get(f"{site.url}/static/{name}")
        assert r.status_code == 200 and len(r.text) > 1000
    # nothing is loaded from the network: every src/href is local
    import re

    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert refs and all(r.startswith("/") for r in refs), refs
    assert "http://" not in httpx.get(site.url + "/static/app.js").text.replace("http://127", "")


@pytest.fixture(scope="module")
def tiny_site(model_pair):
    """The tiny pair, a context that holds two pictures with a 400-token reply reserve."""
    s = Served(model_pair("llava15"), "--parallel", "1", "--ctx", "2048")
    yield s
    assert "Traceback" not in s.stop()


DROP_PICTURE = """
const [kind, name, done] = arguments;
const c = document.createElement("canvas");
c.width = 96; c.height = 64;
const g = c.getContext("2d");
g.fillStyle = kind === "drop" ? "#c33" : "#3c3"; g.fillRect(0, 0, 96, 64);
g.fillStyle = "#fff"; g.fillRect(20, 10, 30, 30);
c.toBlob((blob) => {
  const dt = new DataTransfer();
  dt.items.add(new File([blob], name, {type: "image/png"}));
  if (kind === "drop") {
    const drop = new DragEvent("drop", {dataTransfer: dt, bubbles: true, cancelable: true});
    document.getElementById("composer").dispatchEvent(drop);
  } else {
    document.dispatchEvent(new ClipboardEvent("paste", {clipboardData: dt, bubbles: true, cancelable: true}));
  }
  done();
}, "image/png");
"""


def test_drop_paste_and_the_summary_of_an_old_picture(browser, tiny_site):
    from selenium.webdriver.common.keys import Keys

    d = browser
    d.get(tiny_site.url + "/")
    wait(d, lambda d: by_id(d, "model").text == "model", what="model name")
    by_id(d, "max-tokens").clear()
    by_id(d, "max-tokens").send_keys("400")
    for turn, kind in enumerate(("drop", "paste", "drop")):
        d.execute_async_script(DROP_PICTURE, kind, f"{kind}{turn}.png")
        wait(d, lambda d: "576 tokens" in by_id(d, "attachments").text, what=f"{kind}ped picture cost")
        assert f"{kind}{turn}.png" in by_id(d, "attachments").text
        by_id(d, "input").send_keys(f"Picture {turn + 1}?" + Keys.ENTER)
        wait(d, lambda d, n=turn + 1: len(css(d, ".msg.assistant .meta")) == n, timeout=120, what=f"reply {turn + 1}")
    # the third picture does not fit beside the other two (and 400-token replies): older pictures
    # became the model's summaries, and the page says so in the conversation
    wait(d, lambda d: "was replaced by the model's summary" in by_id(d, "log").text, what="the summary note")
    assert not css(d, ".msg.error")
    shot(d, "summary")
    by_id(d, "input").send_keys("And now?" + Keys.ENTER)  # the shorter history goes on
    wait(d, lambda d: len(css(d, ".msg.assistant .meta")) == 4, timeout=120, what="reply 4")
    assert "(0 cached)" not in css(d, ".msg.assistant .meta")[3].text


@pytest.mark.slow
def test_a_returning_conversation_shows_where_its_cache_came_from(browser, model_pair, tmp_path):
    """Resident in the KV cache while the server runs; from disk after a restart on the same
    --cache-dir (the page re-sends its history to the new server on the same port)."""
    from selenium.webdriver.common.keys import Keys

    pair = model_pair("llava15")
    args = ("--cache-dir", str(tmp_path / "cache"), "--ctx", "2048", "--parallel", "1")
    server = Served(pair, *args)
    d = browser
    try:
        d.get(server.url + "/")
        wait(d, lambda d: by_id(d, "model").text == "model", what="model name")
        wait(d, lambda d: "on disk" in by_id(d, "server").text, what="the kept conversations row")
        d.execute_async_script(DROP_PICTURE, "drop", "kept.png")
        wait(d, lambda d: "576 tokens" in by_id(d, "attachments").text, what="picture cost")
        by_id(d, "input").send_keys("What is it?" + Keys.ENTER)
        wait(d, lambda d: len(css(d, ".msg.assistant .meta")) == 1, timeout=120, what="reply 1")
        by_id(d, "input").send_keys("More?" + Keys.ENTER)
        wait(d, lambda d: len(css(d, ".msg.assistant .meta")) == 2, timeout=120, what="reply 2")
        assert "from resident in the KV cache" in css(d, ".msg.assistant .meta")[1].text
        assert "resident in the KV cache" in by_id(d, "source").text
    finally:
        assert "Traceback" not in server.stop()
    server = Served(pair, *args, port=server.port)  # a restart: the page stays open
    try:
        by_id(d, "input").send_keys("And now?" + Keys.ENTER)
        wait(d, lambda d: len(css(d, ".msg.assistant .meta")) == 3, timeout=120, what="reply 3")
        meta = css(d, ".msg.assistant .meta")[2].text
        assert "from disk (--cache-dir)" in meta, meta
        assert "disk" in by_id(d, "source").text
        wait(d, lambda d: "1 on disk" in by_id(d, "server").text, what="the file in the panel")
        shot(d, "from-disk")
    finally:
        assert "Traceback" not in server.stop()


def test_the_demo_model_answers_on_the_page(browser, tmp_path):
    """The README's screenshot: the trained demo model, greedy, answers a question about one of
    the examples right, beside the memory panel. Written to test-artifacts/readme-page.png, and to
    docs/page.png when EDGEVLM_DOCS_SHOTS=1."""
    from types import SimpleNamespace

    from selenium.webdriver.common.keys import Keys

    root = Path(__file__).resolve().parent.parent
    models = root / "models"
    demo = SimpleNamespace(model=models / "edgevlm-demo.gguf", mmproj=models / "mmproj-edgevlm-demo.gguf")
    s = Served(demo, "--temp", "0", "--parallel", "2", "--model-id", "demo")
    try:
        d = browser
        d.get(s.url + "/")
        wait(d, lambda d: by_id(d, "model").text == "demo", what="model name")
        wait(d, lambda d: "sequences busy" in by_id(d, "server").text and css(d, "#devices .bar"), what="panel")
        by_id(d, "file").send_keys(str(root / "examples" / "shapes.png"))
        wait(d, lambda d: "64 tokens" in by_id(d, "attachments").text, what="picture cost")
        by_id(d, "input").send_keys("What shape is red?" + Keys.ENTER)
        wait(d, lambda d: css(d, ".msg.assistant .meta"), timeout=120, what="the reply's end")
        assert css(d, ".msg.assistant .text")[0].text.strip() == "square"
        by_id(d, "input").send_keys("How many circles are there?" + Keys.ENTER)  # the picture is cached
        wait(d, lambda d: len(css(d, ".msg.assistant .meta")) == 2, timeout=120, what="the second reply")
        assert css(d, ".msg.assistant .text")[1].text.strip() == "2"
        assert "cached" in css(d, ".msg.assistant .meta")[1].text
        wait(d, lambda d: "2 served" in by_id(d, "server").text, what="panel update")
        shot(d, "readme-page")
        if os.environ.get("EDGEVLM_DOCS_SHOTS") == "1":
            shutil.copyfile(ARTIFACTS / "readme-page.png", root / "docs" / "page.png")
    finally:
        assert "Traceback" not in s.stop()


def test_a_clip_is_attached_with_its_frames_and_answered(browser):
    """Attach a video: the page shows the frames the server chose (thumbnails, each with its
    timestamp) and their cost before sending, sends it as a video_url part, and the demo model
    answers about it."""
    from types import SimpleNamespace

    from selenium.webdriver.common.keys import Keys

    root = Path(__file__).resolve().parent.parent
    models = root / "models"
    demo = SimpleNamespace(model=models / "edgevlm-demo.gguf", mmproj=models / "mmproj-edgevlm-demo.gguf")
    s = Served(demo, "--temp", "0", "--model-id", "demo")
    try:
        d = browser
        d.get(s.url + "/")
        wait(d, lambda d: by_id(d, "model").text == "demo", what="model name")
        by_id(d, "file").send_keys(str(root / "examples" / "shapes.mp4"))
        wait(d, lambda d: "2 of 24 frames · 128 tokens" in by_id(d, "attachments").text, what="clip cost")
        frames = css(d, "#attachments .frames img")
        assert [f.get_attribute("alt") for f in frames] == ["shapes.mp4 at [0:00.0]", "shapes.mp4 at [0:03.0]"]
        by_id(d, "input").send_keys("Describe the image." + Keys.ENTER)
        wait(d, lambda d: css(d, ".msg.assistant .meta"), timeout=120, what="the reply's end")
        assert css(d, ".msg.assistant .text")[0].text.strip() == "a white triangle and a green square"
        assert len(css(d, ".msg.user .pics img")) == 2  # the frames it sent
        shot(d, "clip")
    finally:
        assert "Traceback" not in s.stop()
