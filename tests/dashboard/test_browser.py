"""The dashboard in a real headless Chromium (Debian's, driven by Python playwright) against a real
`exo serve` node with the bundled demo model, the way a person uses it: the key prompt, the node, a model
launched with its placement preview, a streamed chat with native-MTP stats, Stop, the MTP switch, a
second daemon joining and leaving live, a daemon restart, and no console errors. Screenshots of every
view (laptop and phone widths, light and dark) land in dashboard/test-artifacts/.

The tests run in file order and share one page: each builds on what the previous one left.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from cluster.daemons import Daemon, wait_for

from .conftest import API_KEY, BROKEN_MODEL, KeyedDaemon, needs

pytestmark = pytest.mark.timeout(240)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Headless, and quiet: without the background-networking flags Chromium keeps calling home.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
LAPTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
VIEWS = ("cluster", "models", "chat", "settings")


@pytest.fixture(scope="module")
def playwright() -> Iterator[Any]:
    needs(Path(CHROMIUM).exists(), "Chromium is missing: `apt-get install chromium` (Debian)")
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        needs(False, "Python playwright is missing: pip install -e '.[dev]'")
        raise
    expect.set_options(timeout=15_000)
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Any) -> Iterator[Any]:
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    yield browser
    browser.close()


@pytest.fixture(scope="module")
def console() -> list[dict[str, str]]:
    """Every console error or warning and uncaught exception of every page, in order."""
    return []


def watch(page: Any, console: list[dict[str, str]]) -> Any:
    page.on("console", lambda m: console.append({"type": m.type, "text": m.text, "url": m.location.get("url", "")})
            if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: console.append({"type": "pageerror", "text": str(e), "url": ""}))
    return page


@pytest.fixture(scope="module")
def page(browser: Any, node: KeyedDaemon, console: list[dict[str, str]]) -> Iterator[Any]:
    context = browser.new_context(viewport=LAPTOP, color_scheme="light")
    yield watch(context.new_page(), console)
    context.close()


def expect(locator: Any) -> Any:
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


def screenshot(page: Any, artifacts: Path, name: str) -> None:
    page.wait_for_timeout(300)  # let transitions settle
    page.screenshot(path=str(artifacts / f"{name}.png"))


def go(page: Any, view: str) -> None:
    page.locator(f'nav a[href="#/{view}"]').click()
    expect(page.locator(f'nav a[href="#/{view}"]')).to_have_attribute("aria-current", "page")


def generations(node: KeyedDaemon) -> dict[str, float]:
    """exo_generations_total for exo-demo, by finish reason."""
    out = {}
    for line in node.api("GET", "/metrics").text.splitlines():
        if m := re.match(r'exo_generations_total\{finish_reason="(\w+)",model="exo-demo"\} (\S+)', line):
            out[m.group(1)] = float(m.group(2))
    return out


def last_reply(page: Any) -> Any:
    return page.get_by_role("article", name="assistant message").last


def background_brightness(page: Any) -> float:
    """The page's background colour (body's computed one) as a mean of its RGB channels, 0 to 255."""
    colour = page.evaluate("getComputedStyle(document.body).backgroundColor")
    channels = [float(c) for c in re.findall(r"[\d.]+", colour)[:3]]
    assert len(channels) == 3, colour
    return sum(channels) / 3


def horizontal_overflow(page: Any) -> dict[str, Any]:
    """How far the page is wider than the window (the document, and <main>, which scrolls by itself),
    with the elements that stick out past the window's right edge, outside any box that scrolls sideways
    on purpose (code blocks, tables, the tab bar)."""
    return page.evaluate("""() => {
        const main = document.querySelector('main');
        const scrolls = (e) => ['auto', 'scroll'].includes(getComputedStyle(e).overflowX) && e !== main;
        const culprits = [...document.querySelectorAll('main *, header *')].filter((e) => {
            if (e.getBoundingClientRect().right <= innerWidth + 0.5) return false;
            for (let p = e.parentElement; p; p = p.parentElement) if (scrolls(p)) return false;
            return true;
        }).slice(0, 5).map((e) => `${e.tagName.toLowerCase()}.${[...e.classList].join('.')}: ${
            e.textContent.trim().slice(0, 40)}`);
        return {document: document.documentElement.scrollWidth - innerWidth,
                main: main.scrollWidth - main.clientWidth, culprits};
    }""")


# -- the flow ---------------------------------------------------------------------------------------------


def test_the_page_asks_for_the_api_key_then_goes_live(page, node, artifacts):
    response = page.goto(node.url + "/")
    assert response.status == 200  # the page itself needs no key
    dialog = page.get_by_role("dialog", name="This node needs an API key")
    expect(dialog).to_be_visible()
    expect(page.locator("main")).to_contain_text("Waiting for the API key…")  # not for the daemon: it answered
    screenshot(page, artifacts, "key-prompt")
    dialog.get_by_label("API key").fill(API_KEY)
    dialog.get_by_role("button", name="Connect").click()
    expect(dialog).to_be_hidden()
    expect(page.get_by_role("status")).to_have_text("Live")
    expect(page.locator("main")).not_to_contain_text("Waiting for")
    page.evaluate("window.__sameDocument = true")  # later tests check nothing reloaded the page


def test_cluster_view_shows_the_node(page, node):
    card = page.get_by_role("article", name="node studio")
    expect(card).to_be_visible()
    expect(card).to_contain_text("this node")
    [me] = node.cluster()["nodes"]
    assert me["chip"], me
    expect(card).to_contain_text(me["backend"])
    expect(card).to_contain_text(me["chip"])
    expect(card.get_by_role("progressbar", name="Memory")).to_have_attribute("aria-valuetext", re.compile(r"GB / .*GB"))
    expect(card).to_contain_text("exo-demo")


def test_the_page_does_not_poll(page):
    """The live state comes through one event stream: a load (the key remembered now) opens it, and
    going through every view and then 5 s of idleness ask the daemon for nothing else (the page's own
    files aside: Chromium fetches the favicon again at each change of view)."""
    requests: list[tuple[str, str]] = []

    def seen(request: Any) -> None:
        requests.append((request.method, urlparse(request.url).path))

    page.on("request", seen)
    try:
        page.reload()
        expect(page.get_by_role("status")).to_have_text("Live")
        expect(page.get_by_role("article", name="node studio")).to_be_visible()
        for view in (*VIEWS, "cluster"):
            go(page, view)
        page.wait_for_timeout(5000)
    finally:
        page.remove_listener("request", seen)
    static = re.compile(r"^/(|favicon\.svg|assets/.+)$")
    api = [(method, path) for method, path in requests if not static.match(path)]
    assert api == [("GET", "/v1/events")], f"the page asked for more than its event stream: {api}"
    page.evaluate("window.__sameDocument = true")


def test_models_view_launches_a_model_after_a_placement_preview(page, node, artifacts):
    go(page, "models")
    model = page.get_by_role("listitem", name="exo demo (dense)")
    expect(model).to_contain_text("MTP · K 2 (max 3)")
    expect(model).to_contain_text("studio")  # on that node's disk
    model.get_by_role("button", name="Launch…").click()
    preview = model.get_by_role("region", name="launch exo-demo")
    expect(preview).to_contain_text("needs")
    expect(preview.locator("ol.stages")).to_contain_text("studio")
    expect(preview.locator("ol.stages")).to_contain_text("layers 0–")
    expect(preview.locator("dl")).to_contain_text("free there")  # one node: what it has free
    screenshot(page, artifacts, "models-launch-preview")
    preview.get_by_role("button", name="Launch", exact=True).click()
    instance = page.locator('article[aria-label="instance of exo-demo"]')
    expect(instance).to_be_visible()
    expect(instance).to_have_attribute("data-state", "ready", timeout=120_000)
    [listed] = node.api("GET", "/v1/instances").json()["instances"]
    assert listed["model"] == "exo-demo" and listed["state"] == "ready" and not listed["on_demand"]


def test_a_model_that_fails_to_load_shows_why(page, node, artifacts):
    model = page.get_by_role("listitem", name="broken demo")
    expect(model).to_contain_text("no MTP")  # and why: its weights cannot even be read
    expect(model).to_contain_text("the MTP head cannot be read")
    # The reason names a file by its absolute path: two lines at most, the whole of it in the title and
    # a click away.
    reason = model.locator(".reason")
    expect(reason).to_have_attribute("title", re.compile(r"^the MTP head cannot be read: /.*model\.safetensors"))
    lines = "e => e.getBoundingClientRect().height / parseFloat(getComputedStyle(e).lineHeight)"
    assert reason.evaluate(lines) <= 2.1
    model.get_by_role("button", name="show all").click()
    assert reason.evaluate(lines) > 2.1
    model.get_by_role("button", name="show less").click()
    assert reason.evaluate(lines) <= 2.1
    model.get_by_role("button", name="Launch…").click()
    model.get_by_role("region", name=f"launch {BROKEN_MODEL}").get_by_role("button", name="Launch", exact=True).click()
    instance = page.locator(f'article[aria-label="instance of {BROKEN_MODEL}"]')
    expect(instance).to_have_attribute("data-state", "failed", timeout=120_000)
    [failed] = [i for i in node.api("GET", "/v1/instances").json()["instances"] if i["model"] == BROKEN_MODEL]
    expect(instance).to_contain_text(f"exit code {failed['failure']['exit_code']}")
    expect(instance).to_contain_text(failed["failure"]["message"][:60])
    instance.get_by_text("Runner output").click()  # the runner's last lines, for a bug report
    expect(instance.locator("pre")).to_contain_text(failed["failure"]["stderr_tail"][-1][:60])
    screenshot(page, artifacts, "models-failed-instance")
    instance.get_by_role("button", name="Dismiss").click()
    expect(instance).to_have_count(0)


def test_downloading_a_model_says_why_it_cannot(page, console):
    page.get_by_label("show models not on any node").check()
    model = page.get_by_role("listitem", name="Qwen3.5 2B (8-bit)")
    model.get_by_role("button", name="Download").click()
    expect(model.get_by_role("alert")).to_contain_text("not in the Hugging Face cache")  # the daemon's words
    page.get_by_label("show models not on any node").uncheck()
    # Chromium logs every refused request; this one (offline, so 404) the page handled and showed.
    refused = wait_for(lambda: [c for c in console if c["url"].endswith("/v1/downloads")], 5, "the console line")
    assert len(refused) == 1 and "404" in refused[0]["text"], console
    console.remove(refused[0])


def test_a_download_shows_up_live_with_its_outcome(page, node, artifacts):
    # Offline, the node "downloads" what its cache holds: the broken model, checked and found wanting.
    assert node.api("POST", "/v1/downloads", json={"model": BROKEN_MODEL}).status_code == 201
    card = page.get_by_role("article", name=f"download of {BROKEN_MODEL}")
    expect(card).to_be_visible()
    expect(card).to_have_attribute("data-status", re.compile("complete|failed"), timeout=60_000)
    [download] = node.api("GET", "/v1/downloads").json()["data"]
    expect(card).to_contain_text(download["status"])
    if download["error"]:
        expect(card).to_contain_text(download["error"]["message"][:60])
    screenshot(page, artifacts, "models-download")
    card.get_by_role("button", name="Dismiss").click()
    expect(card).to_have_count(0)
    assert node.api("GET", "/v1/downloads").json()["data"] == []


def test_chat_streams_a_reply_and_shows_its_native_mtp_stats(page):
    go(page, "chat")
    page.get_by_label("MTP depth").select_option("2")
    page.get_by_text("Options", exact=True).click()
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Temperature").press("Tab")
    # A reply long enough to be seen streaming on a busy host: "Hello" got ~40 tokens, and in a CI run on this
    # 2-core machine all of them reached the page in one read (lengths seen: 0, 163); 160 tokens of counting
    # reached it in two (0, 330, 344). 600 tokens take a few seconds of generation even at full speed.
    page.get_by_label("Max tokens").fill("600")
    page.get_by_label("Max tokens").press("Tab")
    page.get_by_text("Options", exact=True).click()
    # Record the reply's length at every change while it streams, to see it grow in place.
    page.evaluate("""() => {
        window.__lengths = [];
        new MutationObserver(() => {
            const replies = document.querySelectorAll('article.assistant[data-status="streaming"] .body');
            if (replies.length) window.__lengths.push(replies[replies.length - 1].textContent.length);
        }).observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true});
    }""")
    page.get_by_role("textbox", name="Message").fill("Count from 1 to 1000.")  # greedy: up to Max tokens
    page.get_by_role("button", name="Send").click()
    reply = last_reply(page)
    stats = reply.get_by_test_id("message-stats")
    expect(stats).to_contain_text(re.compile(r"acceptance \d+%"), timeout=60_000)
    expect(stats).to_contain_text("MTP K=2")
    expect(stats).to_contain_text(re.compile(r"\d+(\.\d+)? tok/s"))
    expect(stats).to_contain_text(re.compile(r"TTFT \d+"))
    expect(stats).to_contain_text(re.compile(r"\d+/\d+ drafts accepted"))
    expect(reply).to_have_attribute("data-status", "done")
    grew = sorted(set(page.evaluate("window.__lengths")))
    assert len([n for n in grew if n > 0]) >= 3, f"the reply did not stream in: lengths seen {grew}"
    assert reply.locator(".body").inner_text().strip()
    page.get_by_text("Options", exact=True).click()  # the next tests want replies until done
    page.get_by_label("Max tokens").fill("")
    page.get_by_label("Max tokens").press("Tab")
    page.get_by_text("Options", exact=True).click()


def test_stop_ends_the_generation_on_the_daemon(page, node):
    before = generations(node)
    page.get_by_role("textbox", name="Message").fill("Count from 1 to 1000.")  # greedy: thousands of tokens
    page.get_by_role("button", name="Send").click()
    reply = last_reply(page)
    expect(reply).to_have_attribute("data-status", "streaming")
    page.wait_for_function(  # the reply itself has text (not just its footer)
        "() => [...document.querySelectorAll('article.assistant .body')].at(-1)?.textContent.length > 40",
        timeout=60_000,
    )
    wait_for(lambda: any(i["running"] for i in node.api("GET", "/v1/instances").json()["instances"]), 15,
             "the daemon to report the generation running")
    page.get_by_role("button", name="Stop").click()
    expect(reply).to_have_attribute("data-status", "stopped")
    expect(reply).to_contain_text("stopped")
    # The daemon sends its figures only with a finished reply: a stopped one shows what the page measured.
    stats = reply.get_by_test_id("message-stats")
    expect(stats).to_contain_text(re.compile(r"≥\d+ tokens"))
    expect(stats).to_contain_text(re.compile(r"≥\d+(\.\d+)? tok/s"))
    expect(stats).to_contain_text(re.compile(r"TTFT \d+(\.\d+)? (ms|s)"))
    expect(page.get_by_role("button", name="Send")).to_be_visible()
    # The daemon ended it at once (the whole reply would take about a minute here), unfinished: counted,
    # but neither as a stop nor as running out of tokens.
    wait_for(lambda: not any(i["running"] for i in node.api("GET", "/v1/instances").json()["instances"]),
             10, "the generation to end on the daemon")
    after = wait_for(lambda: (g := generations(node)) and sum(g.values()) > sum(before.values()) and g, 10,
                     "the daemon to count the generation")
    for finish in ("stop", "length"):
        assert after.get(finish, 0) == before.get(finish, 0), (before, after)


def test_conversation_is_kept_across_a_reload(page):
    page.reload()
    expect(page.get_by_role("status")).to_have_text("Live")
    go(page, "chat")
    replies = page.get_by_role("article", name="assistant message")
    expect(replies).to_have_count(2)
    expect(replies.first.get_by_test_id("message-stats")).to_contain_text(re.compile(r"acceptance \d+%"))
    expect(replies.last).to_have_attribute("data-status", "stopped")
    expect(replies.last.get_by_test_id("message-stats")).to_contain_text(re.compile(r"tok/s · TTFT \d+"))
    expect(replies.last.locator(".body")).not_to_be_empty()
    expect(page.get_by_role("article", name="user message").first).to_have_text("Count from 1 to 1000.")
    page.evaluate("window.__sameDocument = true")


def test_model_output_is_rendered_as_markdown_never_as_html(page):
    hostile = ('**bold** <img src=x onerror="window.__pwned = 1"> <script>window.__pwned = 2</script>\n\n'
               '[link](javascript:window.__pwned=3)\n\n```python\nprint("<b>not bold</b>")\n```')
    page.evaluate("""(content) => {
        const key = 'exo.dashboard.conversations';
        const data = JSON.parse(localStorage.getItem(key));
        data.conversations.unshift({id: 'hostile', title: 'Hostile', model: 'exo-demo', mtp: 'auto',
            temperature: null, maxTokens: null, updated: Date.now(), messages: [
                {id: 'u', role: 'user', content: '<img src=x onerror="window.__pwned = 4">', status: 'done'},
                {id: 'a', role: 'assistant', content, status: 'done'}]});
        data.activeId = 'hostile';
        localStorage.setItem(key, JSON.stringify(data));
    }""", hostile)
    page.reload()
    reply = last_reply(page)
    expect(reply.locator("strong")).to_have_text("bold")
    expect(reply.locator("pre code")).to_have_text('print("<b>not bold</b>")\n')
    assert reply.locator("img, script, b, a[href^='javascript']").count() == 0
    assert page.get_by_role("article", name="user message").locator("img").count() == 0
    assert page.evaluate("window.__pwned") is None
    page.get_by_role("button", name="Delete Hostile").click()
    expect(page.get_by_role("article", name="assistant message")).to_have_count(2)
    page.evaluate("window.__sameDocument = true")


def test_the_native_mtp_switch_changes_the_node_setting(page, node):
    go(page, "settings")
    switch = page.get_by_role("switch", name="Native MTP")
    expect(switch).to_be_checked()
    expect(switch).to_be_enabled()
    switch.click()
    expect(switch).not_to_be_checked()
    wait_for(lambda: node.api("GET", "/v1/settings").json()["native_mtp_enabled"] is False, 10, "the node to turn MTP off")
    assert node.api("GET", "/v1/settings").json()["sources"]["native_mtp_enabled"] == "api"
    # A change made elsewhere (another dashboard, curl) reaches this page through the event stream.
    node.api("PUT", "/v1/settings", json={"native_mtp_enabled": True})
    expect(switch).to_be_checked()


def test_the_theme_choice_applies_and_is_kept(page):
    html = page.locator("html")
    assert page.evaluate("matchMedia('(prefers-color-scheme: dark)').matches") is False  # the system: light
    expect(html).to_have_attribute("data-theme", "light")
    assert background_brightness(page) > 200
    themes = page.get_by_role("radiogroup", name="Theme")
    themes.get_by_text("dark", exact=True).click()
    expect(themes.get_by_role("radio", name="dark")).to_be_checked()
    expect(html).to_have_attribute("data-theme", "dark")
    page.wait_for_function("parseFloat(getComputedStyle(document.body).backgroundColor.match(/\\d+/)) < 60")
    assert background_brightness(page) < 60
    page.reload()
    expect(page.get_by_role("status")).to_have_text("Live")
    expect(html).to_have_attribute("data-theme", "dark")
    assert background_brightness(page) < 60
    expect(themes.get_by_role("radio", name="dark")).to_be_checked()
    themes.get_by_text("system", exact=True).click()  # the later tests follow the emulated scheme
    expect(html).to_have_attribute("data-theme", "light")
    page.evaluate("window.__sameDocument = true")


@pytest.fixture(scope="module")
def laptop(node: KeyedDaemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A second daemon (no API key; MTP forced off by its environment) that joins the studio node."""
    daemon = Daemon(tmp_path_factory.mktemp("dashboard") / "laptop", "laptop", env={"EXO_NATIVE_MTP_ENABLED": "0"})
    daemon.start(peers=[node.address])
    try:
        daemon.wait_up()
        yield daemon
    finally:
        daemon.stop()


def test_a_second_daemon_joining_appears_live(page, laptop):
    go(page, "cluster")
    expect(page.get_by_role("article", name="node laptop")).to_be_visible(timeout=40_000)
    expect(page.locator("figure.topology svg")).to_have_attribute("aria-label", "2 nodes, 1 link")
    assert page.evaluate("window.__sameDocument") is True  # no reload: the stream brought it


def test_a_pipeline_over_two_nodes_shows_which_layers_run_where(page, node, laptop, artifacts):
    go(page, "models")
    model = page.get_by_role("listitem", name="exo demo (MoE)")
    model.get_by_role("button", name="Launch…").click()
    preview = model.get_by_role("region", name="launch exo-demo-moe")
    preview.get_by_label("Spread over").select_option("2")
    stages = preview.locator("ol.stages li")
    expect(stages).to_have_count(2)
    expect(stages.nth(0)).to_contain_text(re.compile(r"layers 0–\d"))
    expect(preview.locator("ol.stages")).to_contain_text("studio")
    expect(preview.locator("ol.stages")).to_contain_text("laptop")
    summary = preview.locator("dl")
    expect(summary).to_contain_text(re.compile(r"needs\s*[\d.]+ [KMG]?B over 2 nodes"))
    expect(summary).to_contain_text(re.compile(r"least room\s*[\d.]+ [KMG]?B left on (studio|laptop) \(stage [01]\)"))
    expect(summary).not_to_contain_text("free there")  # no single node's wording
    screenshot(page, artifacts, "models-pipeline-preview")
    preview.get_by_role("button", name="Launch", exact=True).click()
    instance = page.locator('article[aria-label="instance of exo-demo-moe"]')
    expect(instance).to_have_attribute("data-state", "ready", timeout=120_000)
    [pipeline] = [i for i in node.api("GET", "/v1/instances").json()["instances"] if i["model"] == "exo-demo-moe"]
    assert {s["node"] for s in pipeline["stages"]} == {node.node_id, laptop.node_id}
    for stage in pipeline["stages"]:
        expect(instance.locator("ol.stages")).to_contain_text(f"layers {stage['start_layer']}–{stage['end_layer'] - 1}")
    go(page, "cluster")  # each node's card lists the pipeline it holds a stage of
    for name in ("studio", "laptop"):
        expect(page.get_by_role("article", name=f"node {name}").locator(
            'article[aria-label="instance of exo-demo-moe"]')).to_be_visible()


def test_a_tensor_group_is_chosen_in_the_launch_dialog_with_both_splits_estimated(page, node, laptop, artifacts):
    [pipeline] = [i for i in node.api("GET", "/v1/instances").json()["instances"] if i["model"] == "exo-demo-moe"]
    assert node.api("DELETE", f"/v1/instances/{pipeline['id']}").status_code == 200
    go(page, "models")
    model = page.get_by_role("listitem", name="exo demo (MoE)")
    expect(model.locator('article[aria-label="instance of exo-demo-moe"]')).to_have_count(0, timeout=30_000)
    model.get_by_role("button", name="Launch…").click()
    preview = model.get_by_role("region", name="launch exo-demo-moe")
    preview.get_by_label("Split").select_option("tensor")
    stages = preview.locator("ol.stages li")
    expect(stages).to_have_count(2)  # a tensor group spans two nodes or more: no need to ask for the spread
    expect(stages.nth(0)).to_contain_text("every layer, slice 1/2")
    expect(stages.nth(1)).to_contain_text("every layer, slice 2/2, leads")
    expect(preview.locator("dl")).to_contain_text(re.compile(r"needs\s*[\d.]+ [KMG]?B over 2 nodes"))
    expect(preview.locator("dl")).to_contain_text("split by heads and columns")
    splits = preview.get_by_role("table", name="estimated speeds")
    expect(splits.locator("tr")).to_have_count(2)  # both ways, each with its estimated speed
    expect(splits.locator("tr").nth(0)).to_contain_text(re.compile(r"(one node|pipeline)\s*≈ [\d.]+ tok/s"))
    expect(splits.locator("tr").nth(1)).to_contain_text(re.compile(r"tensor\s*≈ [\d.]+ tok/s"))
    screenshot(page, artifacts, "models-tensor-preview")
    preview.get_by_role("button", name="Launch", exact=True).click()
    instance = page.locator('article[aria-label="instance of exo-demo-moe"]')
    expect(instance).to_have_attribute("data-state", "ready", timeout=120_000)
    expect(instance.locator(".badge", has_text="tensor")).to_be_visible()
    expect(instance.locator("ol.stages")).to_contain_text("member 1")
    [group] = [i for i in node.api("GET", "/v1/instances").json()["instances"] if i["model"] == "exo-demo-moe"]
    assert group["sharding"] == "tensor" and {s["node"] for s in group["stages"]} == {node.node_id, laptop.node_id}


def test_a_setting_forced_by_the_environment_is_shown_locked(browser, laptop, console, artifacts):
    context = browser.new_context(viewport=LAPTOP)
    other = watch(context.new_page(), console)
    other.goto(laptop.url + "/#/settings")
    switch = other.get_by_role("switch", name="Native MTP")
    expect(switch).to_be_disabled()
    expect(switch).not_to_be_checked()
    expect(other.get_by_role("note")).to_contain_text("EXO_NATIVE_MTP_ENABLED")
    screenshot(other, artifacts, "settings-locked")
    context.close()


def test_screenshots_of_every_view(page, artifacts):
    for scheme in ("light", "dark"):
        page.emulate_media(color_scheme=scheme)
        for width, viewport in (("laptop", LAPTOP), ("phone", PHONE)):
            page.set_viewport_size(viewport)
            for view in VIEWS:
                go(page, view)
                screenshot(page, artifacts, f"{view}-{width}-{scheme}")
                if width == "phone":  # nothing wider than the phone: no sideways scrolling
                    overflow = horizontal_overflow(page)
                    assert overflow["document"] <= 0 and overflow["main"] <= 0, (view, scheme, overflow)
    page.emulate_media(color_scheme="light")
    page.set_viewport_size(LAPTOP)


def test_unloading_instances(page, node):
    go(page, "models")
    for model in ("exo-demo", "exo-demo-moe"):  # one node's, then the tensor group over two
        instance = page.locator(f'article[aria-label="instance of {model}"]')
        instance.get_by_role("button", name="Unload").click()
        expect(instance).to_have_count(0, timeout=30_000)
    assert node.api("GET", "/v1/instances").json()["instances"] == []


def test_a_daemon_that_dies_disappears_live(page, laptop):
    go(page, "cluster")
    laptop.kill()
    expect(page.get_by_role("article", name="node laptop")).to_have_count(0, timeout=30_000)
    expect(page.get_by_role("article", name="node studio")).to_be_visible()


def test_the_page_reconnects_by_itself_after_a_daemon_restart(page, node, console):
    expect(page.get_by_role("status")).to_have_text("Live")
    before = len(console)
    node.stop()
    expect(page.get_by_role("status")).to_have_text("Reconnecting…")
    node.start()
    node.wait_up()
    expect(page.get_by_role("status")).to_have_text("Live", timeout=30_000)
    expect(page.get_by_role("article", name="node studio")).to_be_visible()
    assert page.evaluate("window.__sameDocument") is True
    # While the daemon was down the browser logs the refused connections; nothing else.
    during = console[before:]
    del console[before:]
    assert all("/v1/events" in c["url"] or "ERR_CONNECTION_REFUSED" in c["text"] for c in during), during


def test_no_console_errors(console):
    assert console == []
