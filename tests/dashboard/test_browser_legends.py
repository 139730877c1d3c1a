"""Legible plots in real headless Chromium, on a run of a real Dask cluster with a dozen task
prefixes: every plot of more than one series has a legend, every plot of a page gives a
prefix the same colour and no two prefixes share one, byte axes read as bytes, and ranges of
non-negative data start at 0. Screenshots go to test-artifacts/dashboard/."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.dashboard.conftest import shoot, sources

pytestmark = pytest.mark.browser


def tasks_left(dask_scheduler: Any) -> int:
    return len(dask_scheduler.tasks)


def _work(x: Any, seconds: float) -> Any:
    deadline = time.thread_time() + seconds
    while time.thread_time() < deadline:
        pass
    return x


def parse_chunk(i: int) -> int:
    return _work(i, 0.02)


def call_api(i: int) -> int:
    time.sleep(0.03)
    return i


def clean_rows(i: int) -> int:
    return _work(i, 0.01)


def join_rows(a: int, b: int) -> int:
    return _work(a + b, 0.01)


def score(i: int) -> int:
    return _work(i, 0.02)


def normalise(i: int) -> int:
    return _work(i, 0.005)


def validate(i: int) -> int:
    return _work(i, 0.005)


def enrich(i: int) -> bytes:
    return _work(b"x" * 200_000, 0.01)


def compress(b: bytes) -> int:
    return len(b)


def summarise(*xs: int) -> int:
    return sum(xs)


PREFIXES = ("parse_chunk", "call_api", "clean_rows", "join_rows", "score", "normalise",
            "validate", "enrich", "compress", "summarise")  # fmt: skip


@pytest.fixture(scope="module")
def recorded(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Any, dict[str, Any], dict[str, Any]]]:
    """An embedded server holding two runs of a LocalCluster: chains of ten prefixes over
    three seconds or so (several worker samples), some of them moving data between
    workers, and a dask.array reduction (its own few prefixes); then a short run of two of
    those prefixes."""
    import dask
    import dask.array as da
    from distributed import Client, LocalCluster, span

    from tests.dask.conftest import EmbeddedServer, wait_for_run, wait_until

    server = EmbeddedServer(tmp_path_factory.mktemp("legends") / "data")
    server.start()
    cluster = f"legends-{uuid.uuid4().hex[:8]}"
    try:
        config = {"hindsight.url": server.url, "hindsight.cluster": cluster}
        with dask.config.set(config), LocalCluster(
            n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0",
            scheduler_kwargs={"preload": ["hindsight.dask"]},
        ) as lc, Client(lc) as client:  # fmt: skip
            with span("many-prefixes"):
                n = 24
                parsed = client.map(parse_chunk, range(n))
                fetched = client.map(call_api, range(n))
                cleaned = client.map(clean_rows, parsed)
                joined = client.map(join_rows, cleaned, fetched[::-1])
                scored = client.map(score, joined)
                normal = client.map(normalise, scored)
                valid = client.map(validate, normal)
                blobs = client.map(enrich, valid)
                sizes = client.map(compress, blobs)
                total = client.submit(summarise, *sizes)
                assert total.result() == n * 200_000
                assert da.ones((2000,), chunks=50).sum().compute() == 2000
            del parsed, fetched, cleaned, joined, scored, normal, valid, blobs, sizes, total
            # let the first run's tasks be forgotten (Dask attaches tasks to a live task
            # group of the same name, and so to the earlier span)
            wait_until(lambda: not client.run_on_scheduler(tasks_left), 30, "a clean slate")
            with span("two-prefixes"):
                client.gather(client.map(score, client.map(call_api, range(8))))
        tasks = 9 * n + 1  # and the array reduction's
        run = wait_for_run(server, cluster, "many-prefixes", tasks)
        other = wait_for_run(server, cluster, "two-prefixes", 16)
        for r in (run, other):
            wait_until(lambda r=r: server.get(f"/v1/runs/{r['id']}")["completeness"]["closed"],
                       60, "final batches")  # fmt: skip
        yield server, run, other
    finally:
        server.stop()


# Every Plot of the page: its name, legends (where, and their entries) and how many colours
# its glyphs draw (a multi-line's lines, a field's distinct values), and each legend's box
# against the plot's frame and canvas.
PLOTS_JS = """() => {
  const out = [];
  const colourOf = (r, prop) => {
    const spec = r.glyph[prop];
    if (spec === undefined || spec === null) return [];
    if (spec.field !== undefined) return Array.from(r.data_source.data[spec.field] || []);
    return spec.value === undefined || spec.value === null ? [] : [spec.value];
  };
  for (const doc of Bokeh.documents) {
    for (const p of doc.all_models) {
      if (p.type !== 'Plot' && p.type !== 'Figure') continue;
      const colours = new Set();
      for (const r of p.renderers) {
        if (!r.glyph || !r.visible) continue;
        const kind = r.glyph.type;
        if (kind === 'MultiLine' || kind === 'Line')
          colourOf(r, 'line_color').forEach(c => c && colours.add(c));
        else if (kind !== 'ImageRGBA' && kind !== 'Text' && kind !== 'Segment')
          colourOf(r, 'fill_color').forEach(c => c && colours.add(c));
      }
      const view = Bokeh.index.find_one(p);
      const frame = view ? view.frame.bbox : null;
      const legends = [...p.above, ...p.below, ...p.left, ...p.right, ...p.center]
        .filter(m => m.type === 'Legend').map(l => {
          const b = Bokeh.index.find_one(l).bbox;
          return {side: p.above.includes(l) ? 'above' : p.center.includes(l) ? 'center' : 'side',
                  labels: l.items.map(i => typeof i.label === 'string' ? i.label : i.label.value),
                  box: [b.left, b.top, b.right, b.bottom]};
        });
      out.push({name: p.name, colours: colours.size, legends,
                frame: frame && [frame.left, frame.top, frame.right, frame.bottom],
                canvas: view && [view.bbox.width, view.bbox.height],
                y: p.y_range && [p.y_range.start, p.y_range.end], height: p.height});
    }
  }
  return out;
}"""

# {plot: {prefix: colour}} of every plot of the run page that colours by task prefix.
PREFIX_COLOURS_JS = """() => {
  const find = n => { for (const d of Bokeh.documents) for (const m of d.all_models)
                        if (m.name === n && m.type === 'ColumnDataSource') return m.data;
                      return null; };
  const pairs = (names, colours, keep) => { const out = {};
    for (let i = 0; i < names.length; i++) if (!keep || keep(i)) out[names[i]] = colours[i];
    return out; };
  const stream = find('task-stream-source'), swatches = find('task-stream-legend-source');
  const progress = find('progress'), dag = find('dag-nodes'), act = find('activity-source');
  const profile = find('profile-source');
  return {
    stream: pairs(stream.name, stream.colour, i => stream.alpha[i] === 1 && stream.colour[i] !== 'black'),
    'stream legend': pairs(swatches.label, swatches.colour, i => swatches.alpha[i] === 1),
    progress: pairs(progress.label, progress.colour),
    dag: pairs(dag.prefix, dag.c_prefix),
    activity: pairs(act.prefix, act.colour, i => !act.prefix[i].includes(': ') && act.prefix[i] !== 'N/A'),
    profile: pairs(profile.name, profile.colour, i => profile.bottom[i] === 0),
    replay: replay ? replay.colours : {},
  };
}"""

#: Plots of more than one colour that need no legend, and why.
NO_LEGEND = {"profile": "a flame graph: its frames are labelled on themselves"}


def open_run(page: Any, server: Any, run: dict[str, Any], width: int = 1400) -> None:
    page.set_viewport_size({"width": width, "height": 900})
    page.goto(f"{server.url}/runs/{run['id']}")
    page.wait_for_selector("body[data-complete='1']", timeout=60_000)


def test_every_plot_of_several_series_has_a_legend_above_its_data(recorded, page):
    """The task stream, progress, memory, CPU, activity and task graph
    plots had no legend. Each names its series now, above its frame (off the data), whole
    on the canvas: on a wide screen and on a phone."""
    server, run, _ = recorded
    tasks = server.tasks(run["id"])
    prefixes = {t["prefix"] for t in tasks}
    workers = {t["worker"] for t in tasks}
    for width in (1400, 390):
        open_run(page, server, run, width)
        plots = page.evaluate(PLOTS_JS)
        by_name = {p["name"]: p for p in plots}
        several = [p for p in plots if p["colours"] > 1 and p["name"] not in NO_LEGEND]
        assert {"task-stream", "progress", "memory-managed", "cpu", "tasks", "dag", "activity"} <= {
            p["name"] for p in several
        }, [p["name"] for p in several]
        for p in several:
            assert p["legends"] and all(lg["labels"] for lg in p["legends"]), p
            for lg in p["legends"]:
                left, top, right, bottom = lg["box"]
                assert lg["side"] == "above" and bottom <= p["frame"][1] + 1, (width, p)
                assert left >= 0 and right <= p["canvas"][0] + 1, (width, p)
        page.screenshot(path=f"/tmp/legends-after-{width}.png", full_page=True)
        if width < 1400:
            continue  # a phone's legends cut labels longer than the plot is wide
        # the stream's legend: every prefix computed, and the transfers it drew
        stream = by_name["task-stream"]["legends"][0]["labels"]
        assert prefixes <= set(stream) and "transfer" in stream, stream
        assert set(by_name["progress"]["legends"][0]["labels"]) == prefixes
        for kind in ("memory-managed", "memory-unmanaged", "cpu", "tasks"):
            assert set(by_name[kind]["legends"][0]["labels"]) == workers, kind
        assert set(by_name["dag"]["legends"][0]["labels"]) == prefixes
    shoot(page, "legends-run-phone")
    assert page.errors == []


def test_a_prefix_has_one_colour_on_the_page_and_no_two_share_one(recorded, page):
    """Parse_chunk and call_api were both teal, and an array run's
    three prefixes near-identical purples (Dask hashes a prefix into 18 viridis colours).
    Every plot of the run page gives a prefix the same colour, and the run's prefixes
    (fourteen here) have as many colours."""
    server, run, _ = recorded
    prefixes = {t["prefix"] for t in server.tasks(run["id"])}
    assert len(prefixes) >= 14
    open_run(page, server, run)
    per_plot = page.evaluate(PREFIX_COLOURS_JS)
    colour: dict[str, str] = {}
    for plot, mapping in per_plot.items():
        for prefix, c in mapping.items():
            assert colour.setdefault(prefix, c) == c, (plot, prefix, c, colour[prefix])
    for plot in ("stream", "stream legend", "progress", "dag"):
        assert set(per_plot[plot]) == prefixes, plot
    assert per_plot["activity"] and per_plot["profile"] and per_plot["replay"]
    assert len(set(colour.values())) == len(colour), colour
    # none of them is what the stream draws transfers, disk and failures in
    assert not {"red", "orange", "gray", "black"} & set(colour.values())
    shoot(page, "legends-run")
    assert page.errors == []


def test_a_prefix_has_one_colour_in_both_streams_of_a_comparison(recorded, page):
    server, a, b = recorded
    page.goto(f"{server.url}/compare?a={a['id']}&b={b['id']}")
    page.wait_for_selector("body[data-rendered='1']", timeout=60_000)
    got = page.evaluate(
        """() => [0, 1].map(i => { const s = Bokeh.documents[0].get_model_by_name('compare-stream-' + i).data;
                                   const out = {};
                                   for (let j = 0; j < s.name.length; j++) if (s.alpha[j] === 1) out[s.name[j]] = s.colour[j];
                                   return out; })"""
    )
    shared = set(got[0]) & set(got[1])
    assert shared == {"call_api", "score"}, got
    assert all(got[0][p] == got[1][p] for p in shared), got
    assert len(set(got[0].values())) == len(got[0])
    plots = {p["name"]: p for p in page.evaluate(PLOTS_JS)}
    assert set(plots["compare-1"]["legends"][0]["labels"]) >= shared
    shoot(page, "legends-compare")
    assert page.errors == []


def test_axes_read_as_bytes_and_seconds_and_start_at_zero(recorded, page):
    """Byte axes read "976.563KiB / 1.431MiB", an all-zero spilled
    plot spanned -1 to 1 B and the lines began at -0.45 s. Bytes read as the Python
    formatter writes them, ticks fall a power of two apart, every y range of the time plots
    starts at 0 (an all-zero one spans 0 to 1), and so does the time axis."""
    from services.dashboard.axes import format_bytes

    server, run, _ = recorded
    open_run(page, server, run)
    values = [0, 1, 1000, 1024, 512 * 1024, 1_000_000, 1.5 * 2**20, 1.431 * 2**20, 1.5 * 2**30]
    # the memory plot's axis (the plot, not its lines' source, named so too)
    axis = """(values) => Bokeh.documents.flatMap(d => [...d.all_models]).find(m => m.name === 'memory-managed'
                && m.left !== undefined).left[0]"""
    got = page.evaluate(f"(values) => ({axis})().formatter.doFormat(values, {{loc: 0}})", values)
    assert got == [format_bytes(v) for v in values]
    assert got[5:8] == ["977 KiB", "1.5 MiB", "1.43 MiB"], got
    ticker = page.evaluate(
        f"() => {{ const t = ({axis})().ticker; return [t.base, t.mantissas]; }}"
    )
    assert ticker == [1024, [2**i for i in range(10)]]
    plots = {p["name"]: p for p in page.evaluate(PLOTS_JS)}
    # one time axis: the stream's frame and those of the plots under it (drawn apart) start
    # at one x
    timed = ("task-stream", "progress", "memory-managed", "cpu", "tasks")
    assert len({plots[name]["frame"][0] for name in timed}) == 1, [plots[n]["frame"] for n in timed]
    for name in (
        "progress",
        "memory-managed",
        "memory-unmanaged",
        "memory-spilled",
        "cpu",
        "tasks",
    ):
        start, end = plots[name]["y"]
        assert start == 0 and end > 0, (name, plots[name]["y"])
    spilled = sources(page)["memory-spilled"]
    if not any(y for ys in spilled["ys"] for y in ys if y == y):
        assert plots["memory-spilled"]["y"] == [0, 1]
    start = page.evaluate("() => Bokeh.documents[0].get_model_by_name('run-time').start")
    assert start == 0
    clock = """(ticks) => Bokeh.documents.flatMap(d => [...d.all_models]).find(m => m.name === 'cpu'
                 && m.below !== undefined).below[0].formatter.doFormat(ticks, {loc: 0})"""
    assert page.evaluate(clock, [0, 0.5, 1, 1.5]) == ["0", "0.5", "1", "1.5 s"]
    assert page.evaluate(clock, [0, 0.25, 0.5]) == ["0", "0.25", "0.5 s"]
    assert page.evaluate(clock, [0, 60, 120, 180]) == ["0:00", "1:00", "2:00", "3:00"]
    assert page.evaluate(clock, [3600, 5400]) == ["1:00:00", "1:30:00"]
    assert page.errors == []


def test_the_flame_graph_is_as_tall_as_its_levels(recorded, page):
    """Flame graphs were mostly empty space. The profile's plot is
    about a row of 18 px per level of frames one can see."""
    from services.dashboard.why_plots import MAX_PX, MIN_PX, ROW_PX, SHOWN_WIDTH

    server, run, _ = recorded
    open_run(page, server, run)
    flame = sources(page)["profile-source"]
    levels = 1 + max(b for b, left, right in zip(flame["bottom"], flame["left"], flame["right"], strict=True)
                     if right - left >= SHOWN_WIDTH)  # fmt: skip
    plots = {p["name"]: p for p in page.evaluate(PLOTS_JS)}
    assert plots["profile"]["height"] == max(MIN_PX, min(MAX_PX, 60 + ROW_PX * levels))
    _, top, _, bottom = plots["profile"]["frame"]
    assert (bottom - top) / (plots["profile"]["y"][1] - plots["profile"]["y"][0]) >= ROW_PX * 0.8
    assert page.errors == []
