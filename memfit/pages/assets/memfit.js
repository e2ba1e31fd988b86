// memfit report pages: charts (uPlot) and sortable tables from the page's JSON data block.
// Text from the data reaches the page through textContent only, never as HTML.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("memfit-data").textContent);
  var charts = {};

  function el(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function gib(bytes) {
    return bytes === null || bytes === undefined ? "" : (bytes / 1073741824).toFixed(3);
  }

  function mib(bytes) {
    return (bytes / 1048576).toFixed(2) + " MiB";
  }

  function fmt(v) {
    if (v === null || v === undefined) return "";
    if (Math.abs(v) >= 1e5 || Number.isInteger(v)) return String(Math.round(v * 1000) / 1000);
    return String(parseFloat(Number(v).toPrecision(5)));
  }

  // ---- hover boxes: describe the point under the cursor ------------------------------------------------
  var HOVER = {
    snapshot: function (box, i) {
      var s = data.snapshot;
      var frames = (s.stacks[s.stack[i]] || []).map(function (f) { return s.frames[f]; });
      box.appendChild(el("div", "trace entry " + s.entry[i] + ": " + s.actions[s.action[i]] + " " +
        mib(s.size[i]) + " (stream " + s.stream[i] + ")" +
        (s.time[i] === null ? "" : ", t = " + (s.time[i] / 1e3).toFixed(3) + " ms"), "what"));
      box.appendChild(el("div", "allocated " + gib(s.allocated[i]) + " GiB, reserved " +
        gib(s.reserved[i]) + " GiB after it"));
      if (frames.length) {
        if (s.actions[s.action[i]] !== "alloc") box.appendChild(el("div", "frames of the allocation it frees:", "muted"));
        var ol = el("ol", null, "frames");
        frames.forEach(function (f) { ol.appendChild(el("li", f)); });
        box.appendChild(ol);
      } else {
        box.appendChild(el("div", "no stack frames recorded for this entry", "muted"));
      }
    },
    cells: function (box, i, spec) {
      var c = data.cells[spec.order ? spec.order[i] : i];
      if (!c) return;
      box.appendChild(el("div", c.name + " (" + c.status + ")", "what"));
      box.appendChild(el("div", "peak " + gib(c.peak) + " GiB, predicted " + gib(c.predicted) +
        " GiB, " + fmt(c.tokens_per_s) + " tokens/s, step " + fmt(c.step_s) + " s"));
    },
    steps: function (box, i, spec, u) {
      var parts = [spec.x_label + " " + fmt(u.data[0][i])];
      for (var k = 1; k < u.series.length; k++) {
        var v = u.data[k][i];
        if (v !== null && v !== undefined) parts.push(u.series[k].label + " " + fmt(v));
      }
      box.appendChild(el("div", parts.join(" · ")));
    },
  };

  // ---- charts -----------------------------------------------------------------------------------------------
  function seriesOpts(s) {
    var o = { label: s.label, stroke: s.color, width: 1.5, scale: s.scale, spanGaps: true, points: { show: false } };
    if (s.dash) o.dash = [6, 4];
    if (s.kind === "bars") {
      o.paths = uPlot.paths.bars({ size: [0.7, 80] });
      o.fill = s.color;
    } else if (s.kind === "step") {
      o.paths = uPlot.paths.stepped({ align: 1 });
    } else if (s.kind === "points") {
      o.paths = function () { return null; };
      o.points = { show: true, size: 8, stroke: s.color, fill: s.color };
      o.spanGaps = false;
    }
    return o;
  }

  function axisText(u, splits) {
    return splits.map(function (v) {
      if (v === null || v === undefined) return "";
      var a = Math.abs(v);
      return a !== 0 && (a < 0.01 || a >= 1e6) ? v.toExponential(1) : String(Math.round(v * 1e4) / 1e4);
    });
  }

  function makeChart(id, spec) {
    var target = document.getElementById(id);
    if (!target) return;
    target.textContent = "";
    var bars = spec.series.some(function (s) { return s.kind === "bars"; });
    var xAxis = { label: spec.x_label };
    var scales = { x: { time: !!spec.x_time }, y: { auto: true } };
    if (spec.x_names) {  // categories at 0, 1, 2, ...: their names under the ticks, half a step of room each side
      xAxis.values = function (u, splits) {
        return splits.map(function (v) { return Number.isInteger(v) && spec.x_names[v] !== undefined ? spec.x_names[v] : ""; });
      };
      xAxis.splits = function () { return spec.x.slice(); };
      scales.x.range = function () { return [-0.5, spec.x.length - 0.5]; };
    }
    if (bars) scales.y.range = function (u, lo, hi) { return [0, hi > 0 ? hi * 1.05 : 1]; };
    var axes = [xAxis, { label: spec.y_label, scale: "y", size: 70, values: axisText }];
    if (spec.y2_label) {
      axes.push({ label: spec.y2_label, scale: "y2", side: 1, grid: { show: false }, size: 70, values: axisText });
      scales.y2 = { auto: true };
    }
    var hoverBox = document.getElementById(id + "-hover");
    var opts = {
      title: spec.title,
      width: Math.max(320, target.clientWidth || 900),
      height: spec.height,
      scales: scales,
      axes: axes,
      series: [{ label: spec.x_label }].concat(spec.series.map(seriesOpts)),
      cursor: { drag: { x: true, y: false, setScale: true } },
      hooks: {
        setCursor: [function (u) {
          if (!hoverBox || u.cursor.idx === null || u.cursor.idx === undefined) return;
          hoverBox.textContent = "";
          HOVER[spec.hover](hoverBox, u.cursor.idx, spec, u);
        }],
      },
    };
    if (spec.hover === "snapshot") {  // the timeline's points are the snapshot's entries, held once in the data
      var toGib = function (b) { return b / 1073741824; };
      spec.x = data.snapshot.entry;
      spec.series[0].values = data.snapshot.allocated.map(toGib);
      spec.series[1].values = data.snapshot.reserved.map(toGib);
    }
    var aligned = [spec.x].concat(spec.series.map(function (s) { return s.values; }));
    charts[id] = new uPlot(opts, aligned, target);
  }

  Object.keys(data.charts).forEach(function (id) { makeChart(id, data.charts[id]); });
  window.addEventListener("resize", function () {
    Object.keys(charts).forEach(function (id) {
      var t = document.getElementById(id);
      charts[id].setSize({ width: Math.max(320, t.clientWidth), height: data.charts[id].height });
    });
  });

  // ---- sortable tables ------------------------------------------------------------------------------------
  function sortKey(td) {
    var raw = (td.hasAttribute("data-sort") ? td.getAttribute("data-sort") : td.textContent).trim();
    return /^[-+]?\d*\.?\d+(e[-+]?\d+)?$/i.test(raw) ? parseFloat(raw) : raw.toLowerCase();
  }

  document.querySelectorAll("table.sortable").forEach(function (table) {
    table.querySelectorAll("th").forEach(function (th, col) {
      th.title = "sort by this column";
      th.addEventListener("click", function () {
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        var up = th.getAttribute("data-dir") !== "up";
        table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("data-dir"); });
        th.setAttribute("data-dir", up ? "up" : "down");
        rows.sort(function (a, b) {
          var x = sortKey(a.cells[col]), y = sortKey(b.cells[col]);
          if (typeof x !== typeof y) { x = String(x); y = String(y); }
          return (x < y ? -1 : x > y ? 1 : 0) * (up ? 1 : -1);
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  });

  // ---- plan page: the chosen candidate's breakdown by phase and category --------------------------------
  function showBreakdown(i) {
    var c = data.candidates[i];
    var box = document.getElementById("breakdown");
    if (!c || !box) return;
    box.textContent = "";
    box.appendChild(el("p", "candidate " + c.label + ": peak " + gib(c.peak_bytes) + " GiB in " +
      c.peak_phase + (c.host_peak_bytes ? ", host " + gib(c.host_peak_bytes) + " GiB" : ""), "what"));
    var phases = Object.keys(c.phase_peaks_bytes);
    var cats = data.categories;
    var t = el("table", null, "plain");
    var head = el("tr");
    head.appendChild(el("th", "phase (GiB at its peak)"));
    cats.forEach(function (k) { head.appendChild(el("th", k)); });
    head.appendChild(el("th", "device total"));
    t.appendChild(head);
    phases.forEach(function (p) {
      var tr = el("tr");
      tr.appendChild(el("td", p));
      var total = 0;
      cats.forEach(function (k) {
        var v = c.phase_peaks_bytes[p][k] || 0;
        if (data.device_categories.indexOf(k) >= 0) total += v;
        tr.appendChild(el("td", gib(v)));
      });
      tr.appendChild(el("td", gib(total)));
      t.appendChild(tr);
    });
    box.appendChild(t);
    var fig = el("div", null, "chart");
    fig.id = "breakdown-chart";
    box.appendChild(fig);
    // stacked bars: each series is the sum of its category and those before it, drawn from the top down
    var device = cats.filter(function (k) { return data.device_categories.indexOf(k) >= 0; });
    var running = phases.map(function () { return 0; });
    var stacked = device.map(function (k) {
      running = running.map(function (r, j) { return r + (c.phase_peaks_bytes[phases[j]][k] || 0) / 1073741824; });
      return running.slice();
    });
    var series = device.map(function (k, j) {
      return { label: k, values: stacked[j], color: data.colors[k], kind: "bars", scale: "y", dash: false };
    }).reverse();
    if (charts["breakdown-chart"]) charts["breakdown-chart"].destroy();
    data.charts["breakdown-chart"] = {
      title: "device bytes at each phase's peak, stacked by category (hover for values)",
      x: phases.map(function (_, j) { return j; }),
      x_names: phases, x_label: "phase", y_label: "GiB", series: series, height: 260, hover: null,
    };
    makeChart("breakdown-chart", data.charts["breakdown-chart"]);
  }

  if (data.candidates) {
    document.querySelectorAll("#candidates tbody tr").forEach(function (tr) {
      tr.addEventListener("click", function () {
        document.querySelectorAll("#candidates tr.chosen").forEach(function (r) { r.classList.remove("chosen"); });
        tr.classList.add("chosen");
        showBreakdown(parseInt(tr.getAttribute("data-row"), 10));
      });
    });
    var first = document.querySelector("#candidates tbody tr");
    if (first) first.classList.add("chosen");
    showBreakdown(0);
  }
})();
