#!/usr/bin/env python3
"""plot_train_log.py - plot the log.jsonl that `dflash train` writes into its run directory.

    python3 scripts/plot_train_log.py RUN/log.jsonl [--out PNG] [--title T]

RUN (the directory) is accepted for RUN/log.jsonl. Renders one figure, by default next to the
log (RUN/log.png), with panels:
    loss (+ eval_loss)          tau_hat (+ eval_tau_hat)
    acc[k], k = 1, 2, 4, last   tokens/s (+ step_s on a right-hand axis)
    small: lr, grad_norm, then any other numeric field present (mfu, data_wait, mem_gib, ...)
Epoch boundaries are dotted vertical lines. With matplotlib the figure is a PNG (or whatever
--out's extension asks for: .png .svg .pdf). Without matplotlib (or with DFLASH_PLOT_NO_MPL=1)
a self-contained SVG is written instead, at the --out path with its extension changed to .svg.

Input robustness: blank lines are ignored; malformed lines (bad JSON, not an object, no numeric
"step") are skipped with a warning naming the line number; bare nan/inf values (C printf of a
diverged loss) are read as missing; a step that goes backwards (a resumed run appended to an
old log) drops the earlier records from that step on; missing fields leave gaps or "no data".
Python 3.9+ standard library only; matplotlib optional.

Exit codes: 0 ok, 1 bad input (missing/empty/unreadable log, no valid records, can't write),
2 bad usage.
"""

import argparse
import json
import math
import os
import re
import sys

# Fields that have a panel of their own; every other numeric field gets a small panel.
MAIN_KEYS = {"step", "epoch", "loss", "eval_loss", "tau_hat", "eval_tau_hat", "acc", "eval_acc",
             "tokens", "tokens_per_s", "step_s", "lr"}
SMALL_ORDER = ["lr", "grad_norm", "mfu", "data_wait", "mem_gib"]
UNITS = {"mem_gib": "GiB", "data_wait": "", "step_s": "s", "tokens_per_s": "tokens/s"}
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf"]

_NONFINITE = re.compile(r"(?<=[:\[,])(\s*)[-+]?(?:nan|inf(?:inity)?)\b", re.IGNORECASE)


class InputError(Exception):
    pass


def warn(msg):
    print("warning: " + msg, file=sys.stderr)


def _num(v):
    """v as a finite float, or None (bools, strings, nulls, nan and inf are not numbers here)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


# ------------------------------------------------------------------------ reading

def read_log(path):
    """The records of the log (dicts with a numeric 'step'), in step order."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise InputError("cannot read %s: %s" % (path, e.strerror or e))
    text = raw.decode("utf-8", errors="replace")
    if not text.strip():
        raise InputError("%s is empty: no log records to plot" % path)
    recs, skipped, nonfinite, restarts = [], 0, 0, 0
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            fixed, subs = _NONFINITE.subn(r"\1null", line)
            try:
                obj = json.loads(fixed) if subs else None
            except ValueError:
                obj = None
            if obj is None:
                warn("%s:%d: malformed JSON, line skipped (%s)" % (path, n, e))
                skipped += 1
                continue
            nonfinite += subs
        if not isinstance(obj, dict):
            warn("%s:%d: not a JSON object, line skipped" % (path, n))
            skipped += 1
            continue
        if isinstance(obj.get("run"), dict):  # a (re)start's metadata line: no figures
            continue
        step = _num(obj.get("step"))
        if step is None:
            warn("%s:%d: no numeric \"step\", line skipped" % (path, n))
            skipped += 1
            continue
        obj["step"] = step
        if recs and recs[-1]["step"] == step and not (set(obj) - {"step"}) & (set(recs[-1]) - {"step"}):
            # `dflash train` writes a step's evaluation (eval_* fields) as its own line after the
            # step's training line: the same step with new fields is one record, not a restart.
            recs[-1].update(obj)
            continue
        if recs and recs[-1]["step"] >= step:
            if not restarts:
                warn("%s:%d: step %g goes back (a resumed run?): the later records replace the "
                     "earlier ones from that step on" % (path, n, step))
            restarts += 1
            while recs and recs[-1]["step"] >= step:
                recs.pop()
        recs.append(obj)
    if nonfinite:
        warn("%s: %d nan/inf value(s) read as missing" % (path, nonfinite))
    if not recs:
        raise InputError("%s: no valid log records (%d malformed line(s) skipped)" % (path, skipped))
    return recs


# ------------------------------------------------------------------------ panels

class Series:
    def __init__(self, label, xs, ys, color, dashed=False, points=False):
        self.label, self.xs, self.ys, self.color = label, xs, ys, color
        self.dashed, self.points = dashed, points


class Panel:
    def __init__(self, title, ylabel, small=False):
        self.title, self.ylabel, self.small = title, ylabel, small
        self.left, self.right, self.right_label = [], [], ""

    def has_data(self):
        return any(s.xs for s in self.left + self.right)


def scalar_series(recs, key):
    xs, ys = [], []
    for r in recs:
        v = _num(r.get(key))
        if v is not None:
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def list_series(recs, key, idx):
    xs, ys = [], []
    for r in recs:
        a = r.get(key)
        if isinstance(a, list) and idx < len(a):
            v = _num(a[idx])
            if v is not None:
                xs.append(r["step"])
                ys.append(v)
    return xs, ys


def _last(ys):
    return " (last %s)" % fmt_value(ys[-1]) if ys else ""


def build_panels(recs):
    panels = []

    p = Panel("loss", "loss")
    xs, ys = scalar_series(recs, "loss")
    p.left.append(Series("train" + _last(ys), xs, ys, COLORS[0]))
    xs, ys = scalar_series(recs, "eval_loss")
    if xs:
        p.left.append(Series("eval" + _last(ys), xs, ys, COLORS[3], points=True))
    panels.append(p)

    p = Panel("tau_hat (expected accepted length)", "tau_hat")
    xs, ys = scalar_series(recs, "tau_hat")
    p.left.append(Series("train" + _last(ys), xs, ys, COLORS[0]))
    xs, ys = scalar_series(recs, "eval_tau_hat")
    if xs:
        p.left.append(Series("eval" + _last(ys), xs, ys, COLORS[3], points=True))
    panels.append(p)

    p = Panel("per-position accuracy acc[k]", "accuracy")
    n_acc = max([len(r["acc"]) for r in recs if isinstance(r.get("acc"), list)] or [0])
    n_eacc = max([len(r["eval_acc"]) for r in recs if isinstance(r.get("eval_acc"), list)] or [0])
    ks = sorted({k for k in (1, 2, 4, n_acc) if 1 <= k <= n_acc})
    for i, k in enumerate(ks):
        xs, ys = list_series(recs, "acc", k - 1)
        p.left.append(Series("k=%d%s" % (k, _last(ys)), xs, ys, COLORS[i % len(COLORS)]))
        if k <= n_eacc:
            xs, ys = list_series(recs, "eval_acc", k - 1)
            p.left.append(Series("eval k=%d" % k, xs, ys, COLORS[i % len(COLORS)], dashed=True,
                                 points=True))
    panels.append(p)

    p = Panel("throughput", "tokens/s")
    xs, ys = scalar_series(recs, "tokens_per_s")
    p.left.append(Series("tokens/s" + _last(ys), xs, ys, COLORS[0]))
    xs, ys = scalar_series(recs, "step_s")
    if xs:
        p.right.append(Series("step_s" + _last(ys), xs, ys, COLORS[1], dashed=True))
        p.right_label = "step_s (s)"
    panels.append(p)

    extra = set()
    for r in recs:
        for k, v in r.items():
            if k not in MAIN_KEYS and _num(v) is not None:
                extra.add(k)
    smalls = ["lr"] + [k for k in SMALL_ORDER[1:] if k in extra]
    smalls += sorted(extra - set(SMALL_ORDER))
    for i, key in enumerate(smalls):
        unit = UNITS.get(key, "")
        p = Panel(key, key + (" (%s)" % unit if unit else ""), small=True)
        xs, ys = scalar_series(recs, key)
        p.left.append(Series(key + _last(ys), xs, ys, COLORS[(i + 2) % len(COLORS)]))
        panels.append(p)
    return panels


def epoch_boundaries(recs):
    """Steps where the epoch field changes (drawn as dotted vertical lines)."""
    out, prev = [], None
    for r in recs:
        e = _num(r.get("epoch"))
        if e is None:
            continue
        if prev is not None and e != prev:
            out.append(r["step"])
        prev = e
    return out


# ------------------------------------------------------------------------ number formatting

def fmt_value(v):
    """A compact label for a single value (legend 'last' values)."""
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1e9:
        return "%.3gG" % (v / 1e9)
    if a >= 1e6:
        return "%.3gM" % (v / 1e6)
    if a >= 1e4:
        return "%.3gk" % (v / 1e3)
    if a < 1e-2:
        return "%.2e" % v
    return "%.4g" % v


def nice_step(span, n=5):
    raw = span / n
    mag = 10.0 ** math.floor(math.log10(raw))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if m * mag >= raw * (1 - 1e-9):
            return m * mag
    return 10.0 * mag


def nice_axis(lo, hi, n=5):
    """(axis_lo, axis_hi, ticks): axis ends on ticks, so its min and max are labelled."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        lo, hi = 0.0, 1.0
    if hi < lo:
        lo, hi = hi, lo
    if hi - lo <= abs(hi) * 1e-12 or hi == lo:  # flat (or a single point)
        d = abs(lo) * 0.1 if lo else 1.0
        lo, hi = lo - d, hi + d
    step = nice_step(hi - lo, n)
    a = math.floor(lo / step + 1e-9) * step
    b = math.ceil(hi / step - 1e-9) * step
    count = int(round((b - a) / step))
    ticks = [a + i * step for i in range(count + 1)]
    return a, b, ticks


def tick_labels(ticks):
    if len(ticks) < 2:
        return [fmt_value(t) for t in ticks]
    step = abs(ticks[1] - ticks[0])
    big = max(abs(t) for t in ticks)
    scale, suffix, expo = 1.0, "", None
    if big >= 1e9:
        scale, suffix = 1e9, "G"
    elif big >= 1e6:
        scale, suffix = 1e6, "M"
    elif big >= 1e4:
        scale, suffix = 1e3, "k"
    elif big < 1e-2:
        expo = math.floor(math.log10(big))
        scale = 10.0 ** expo
    s = step / scale
    dec = 0
    while dec < 8 and abs(round(s, dec) - s) > s * 1e-6:
        dec += 1
    out = []
    for t in ticks:
        v = t / scale
        if abs(v) < s * 1e-6:
            out.append("0")
        elif expo is not None:
            out.append("%.*fe%d" % (dec, v, expo))
        else:
            out.append("%.*f%s" % (dec, v, suffix))
    return out


# ------------------------------------------------------------------------ matplotlib

def render_matplotlib(plt, panels, vlines, xrange, title, out):
    smalls = [p for p in panels if p.small]
    bigs = [p for p in panels if not p.small]
    small_rows = (len(smalls) + 2) // 3
    big_rows = (len(bigs) + 1) // 2
    size = (15, 4.3 * big_rows + 2.7 * small_rows + 0.6)
    try:
        fig = plt.figure(figsize=size, layout="constrained")
    except TypeError:  # matplotlib < 3.5
        fig = plt.figure(figsize=size, constrained_layout=True)
    gs = fig.add_gridspec(big_rows + small_rows, 6,
                          height_ratios=[3.0] * big_rows + [1.8] * small_rows)
    for i, p in enumerate(bigs):
        c = (i % 2) * 3
        draw_mpl_panel(fig.add_subplot(gs[i // 2, c:c + 3]), p, vlines, xrange)
    for i, p in enumerate(smalls):
        c = (i % 3) * 2
        draw_mpl_panel(fig.add_subplot(gs[big_rows + i // 3, c:c + 2]), p, vlines, xrange)
    fig.suptitle(title)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _mpl_plot(ax, s):
    marker = "o" if (s.points or len(s.xs) <= 30) else None
    ax.plot(s.xs, s.ys, color=s.color, linewidth=1.3, linestyle="--" if s.dashed else "-",
            marker=marker, markersize=3.5 if marker else 0, label=s.label)


def _mpl_yformat(ax, series):
    """330k rather than 3.3 x 1e5 for big values (tokens/s); 1e-4 style for small ones (lr)."""
    ys = [abs(v) for s in series for v in s.ys]
    try:
        if ys and max(ys) >= 1e4:
            from matplotlib.ticker import EngFormatter
            ax.yaxis.set_major_formatter(EngFormatter(sep=""))
        else:
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    except (AttributeError, ValueError, ImportError, TypeError):
        pass


def draw_mpl_panel(ax, p, vlines, xrange):
    ax.set_title(p.title, fontsize=10 if p.small else 11)
    ax.set_xlabel("step")
    ax.set_ylabel(p.ylabel)
    ax.grid(True, alpha=0.3)
    lo, hi = xrange  # one step axis for every panel, so they line up
    pad = (hi - lo) * 0.02 if hi > lo else max(abs(lo) * 0.1, 1.0)
    ax.set_xlim(lo - pad, hi + pad)
    for x in vlines:
        ax.axvline(x, color="0.6", linestyle=":", linewidth=0.9)
    if not p.has_data():
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center",
                color="0.5")
        return
    for s in p.left:
        if s.xs:
            _mpl_plot(ax, s)
    _mpl_yformat(ax, p.left)
    handles, labels = ax.get_legend_handles_labels()
    if p.right:
        ax2 = ax.twinx()
        for s in p.right:
            if s.xs:
                _mpl_plot(ax2, s)
        _mpl_yformat(ax2, p.right)
        ax2.set_ylabel(p.right_label, color=p.right[0].color)
        ax2.tick_params(axis="y", colors=p.right[0].color)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        # "best" only sees the left axis' lines: with a twin axis keep to a fixed corner
        ax.legend(handles, labels, fontsize=8, loc="upper left" if p.right else "best",
                  framealpha=0.85)


# ------------------------------------------------------------------------ SVG fallback

def _esc(s):
    return (str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;"))


def _text_w(s, size):
    return len(s) * size * 0.58


def _decimate(xs, ys, x0, x1, px):
    """At most ~4 points per pixel column (first, min, max, last) so long runs stay small."""
    if len(xs) <= 4 * px or x1 <= x0:
        return list(zip(xs, ys))
    buckets = {}
    order = []
    for x, y in zip(xs, ys):
        b = int((x - x0) / (x1 - x0) * px)
        if b not in buckets:
            buckets[b] = [(x, y), (x, y), (x, y), (x, y)]
            order.append(b)
        else:
            e = buckets[b]
            if y < e[1][1]:
                e[1] = (x, y)
            if y > e[2][1]:
                e[2] = (x, y)
            e[3] = (x, y)
    out = []
    for b in order:
        pts = sorted(set(buckets[b]), key=lambda t: t[0])
        out.extend(pts)
    return out


class Svg:
    def __init__(self):
        self.parts = []

    def add(self, s):
        self.parts.append(s)

    def text(self, x, y, s, size=11, anchor="start", color="#222", weight=None, rotate=None):
        extra = ' font-weight="%s"' % weight if weight else ""
        if rotate is not None:
            extra += ' transform="rotate(%g %.1f %.1f)"' % (rotate, x, y)
        self.add('<text x="%.1f" y="%.1f" font-size="%g" text-anchor="%s" fill="%s"%s>%s</text>'
                 % (x, y, size, anchor, color, extra, _esc(s)))

    def line(self, x1, y1, x2, y2, color="#000", width=1.0, dash=None):
        d = ' stroke-dasharray="%s"' % dash if dash else ""
        self.add('<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="%g"%s/>'
                 % (x1, y1, x2, y2, color, width, d))


def draw_svg_panel(svg, p, vlines, xrange, x, y, w, h):
    """Panel p in the box (x, y, w, h): title, legend, plot area with ticks, labels, lines."""
    fs = 10 if p.small else 11
    svg.add('<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="#fff" stroke="#ddd"/>'
            % (x + 2, y + 2, w - 4, h - 4))
    svg.text(x + w / 2, y + 18, p.title, size=fs + 2, anchor="middle", weight="bold")
    # legend: a row (wrapping) of colored line + label under the title
    items = [s for s in p.left + p.right if s.xs]
    lx, ly = x + 70, y + 34
    for s in items:
        iw = 26 + _text_w(s.label, 10) + 14
        if lx + iw > x + w - 10 and lx > x + 70:
            lx, ly = x + 70, ly + 14
        svg.line(lx, ly - 4, lx + 20, ly - 4, s.color, 2, "5,3" if s.dashed else None)
        svg.text(lx + 25, ly, s.label, size=10)
        lx += iw
    px0 = x + 70
    px1 = x + w - (66 if p.right else 20)
    py0 = ly + 10
    py1 = y + h - 42
    svg.add('<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="none" stroke="#444"/>'
            % (px0, py0, px1 - px0, py1 - py0))
    svg.text(px0 + (px1 - px0) / 2, y + h - 10, "step", size=fs, anchor="middle")
    svg.text(x + 16, py0 + (py1 - py0) / 2, p.ylabel, size=fs, anchor="middle", rotate=-90)
    if not p.has_data():
        svg.text(px0 + (px1 - px0) / 2, py0 + (py1 - py0) / 2, "no data", size=12,
                 anchor="middle", color="#888")
        return

    xa, xb, xt = nice_axis(xrange[0], xrange[1], 6 if not p.small else 4)

    def X(v):
        return px0 + (v - xa) / (xb - xa) * (px1 - px0)

    for t, lab in zip(xt, tick_labels(xt)):
        svg.line(X(t), py0, X(t), py1, "#eee")
        svg.line(X(t), py1, X(t), py1 + 5, "#444")
        svg.text(X(t), py1 + 17, lab, size=10, anchor="middle")
    for v in vlines:
        if xa <= v <= xb:
            svg.line(X(v), py0, X(v), py1, "#999", 1, "2,3")

    def axis(series, side):
        ys = [v for s in series for v in s.ys]
        if not ys:
            return
        ya, yb, yt = nice_axis(min(ys), max(ys), 5 if not p.small else 3)

        def Y(v):
            return py1 - (v - ya) / (yb - ya) * (py1 - py0)

        for t, lab in zip(yt, tick_labels(yt)):
            if side == "left":
                svg.line(px0, Y(t), px1, Y(t), "#eee")
                svg.line(px0 - 5, Y(t), px0, Y(t), "#444")
                svg.text(px0 - 8, Y(t) + 3.5, lab, size=10, anchor="end")
            else:
                svg.line(px1, Y(t), px1 + 5, Y(t), series[0].color)
                svg.text(px1 + 8, Y(t) + 3.5, lab, size=10, color=series[0].color)
        for s in series:
            if not s.xs:
                continue
            pts = _decimate(s.xs, s.ys, xa, xb, int(px1 - px0))
            coords = " ".join("%.1f,%.1f" % (X(a), Y(b)) for a, b in pts)
            dash = ' stroke-dasharray="6,3"' if s.dashed else ""
            if len(pts) > 1:
                svg.add('<polyline points="%s" fill="none" stroke="%s" stroke-width="1.4" '
                        'stroke-linejoin="round"%s/>' % (coords, s.color, dash))
            if s.points or len(pts) <= 30:
                for a, b in pts:
                    svg.add('<circle cx="%.1f" cy="%.1f" r="2.6" fill="%s"/>'
                            % (X(a), Y(b), s.color))

    axis(p.left, "left")
    if p.right:
        axis(p.right, "right")
        svg.text(x + w - 10, py0 + (py1 - py0) / 2, p.right_label, size=fs, anchor="middle",
                 rotate=90, color=p.right[0].color)


def render_svg(panels, vlines, xrange, title, out):
    W = 1400
    bigs = [p for p in panels if not p.small]
    smalls = [p for p in panels if p.small]
    big_rows, small_rows = (len(bigs) + 1) // 2, (len(smalls) + 2) // 3
    BH, SH, top = 360, 240, 40
    H = top + big_rows * BH + small_rows * SH + 10
    svg = Svg()
    svg.add('<?xml version="1.0" encoding="UTF-8"?>')
    svg.add('<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" '
            'font-family="DejaVu Sans, Helvetica, Arial, sans-serif">' % (W, H, W, H))
    svg.add('<rect width="100%" height="100%" fill="#f7f7f7"/>')
    svg.text(W / 2, 26, title, size=16, anchor="middle", weight="bold")
    for i, p in enumerate(bigs):
        draw_svg_panel(svg, p, vlines, xrange, (i % 2) * W / 2, top + (i // 2) * BH, W / 2, BH)
    for i, p in enumerate(smalls):
        draw_svg_panel(svg, p, vlines, xrange, (i % 3) * W / 3, top + big_rows * BH + (i // 3) * SH,
                       W / 3, SH)
    svg.add("</svg>")
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(svg.parts) + "\n")


# ------------------------------------------------------------------------ main

def load_matplotlib():
    if os.environ.get("DFLASH_PLOT_NO_MPL"):
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except Exception:  # not installed, or broken: the SVG fallback still works
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Plot a `dflash train` log.jsonl (loss, tau_hat, acc[k], throughput, lr, ...).")
    ap.add_argument("log", help="RUN/log.jsonl (or the RUN directory)")
    ap.add_argument("--out", help="output image (default: log.png next to the log; .png/.svg/.pdf "
                    "with matplotlib, else an SVG at this path with .svg)")
    ap.add_argument("--title", help="figure title (default: the run directory and last step)")
    args = ap.parse_args(argv)  # exits 2 on bad usage

    log = args.log
    if os.path.isdir(log):
        log = os.path.join(log, "log.jsonl")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(log)), "log.png")
    root, ext = os.path.splitext(out)
    if not ext:
        out, ext = out + ".png", ".png"
    if ext.lower() not in (".png", ".svg", ".pdf"):
        ap.error("--out: unsupported extension %r (use .png, .svg or .pdf)" % ext)

    try:
        recs = read_log(log)
    except InputError as e:
        print("error: %s" % e, file=sys.stderr)
        return 1

    panels = build_panels(recs)
    vlines = epoch_boundaries(recs)
    xrange = (recs[0]["step"], recs[-1]["step"])
    title = args.title
    if title is None:
        run = os.path.basename(os.path.dirname(os.path.abspath(log))) or log
        title = "dflash train: %s (step %g, %d record%s)" % (
            run, recs[-1]["step"], len(recs), "" if len(recs) == 1 else "s")

    plt = load_matplotlib()
    try:
        if os.path.dirname(out):
            os.makedirs(os.path.dirname(out), exist_ok=True)
        if plt is not None:
            render_matplotlib(plt, panels, vlines, xrange, title, out)
            print("wrote %s" % out)
        else:
            svg_out = root + ".svg"
            render_svg(panels, vlines, xrange, title, svg_out)
            if ext.lower() == ".svg":
                print("wrote %s (matplotlib not used: built-in SVG renderer)" % svg_out)
            else:
                print("matplotlib was not found (pip install matplotlib for a %s); "
                      "wrote an SVG instead: %s" % (ext.lstrip(".").upper(), svg_out))
    except OSError as e:
        print("error: cannot write %s: %s" % (out if plt is not None else root + ".svg",
                                              e.strerror or e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
