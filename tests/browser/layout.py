"""What a person would call broken in a widget on screen, measured in the page.

Each check returns what it found as short strings (empty when the widget looks right).
"""

from __future__ import annotations

# Text a control or an HTML pane cannot show in full: its content is wider or taller than its
# box while the box hides the rest (hidden overflow or an ellipsis).
_CLIPPED = """root => {
  const shown = e => e.offsetParent !== null && e.getBoundingClientRect().width > 0;
  const hides = s => s.textOverflow === 'ellipsis' || s.overflowX === 'hidden' || s.overflowY === 'hidden';
  const found = [];
  const texts = 'button, .widget-label, .widget-label-basic, .widget-html-content, .widget-checkbox label';
  for (const e of root.querySelectorAll(texts)) {
    const text = (e.innerText || '').trim();
    if (!text || !shown(e) || !hides(getComputedStyle(e))) continue;
    if (e.scrollWidth > e.clientWidth + 1 || e.scrollHeight > e.clientHeight + 2)
      found.push(`${text.slice(0, 40)} (needs ${e.scrollWidth}x${e.scrollHeight} px, has ${e.clientWidth}x${e.clientHeight})`);
  }
  return found;
}"""

# Axis titles of bqplot figures that cover one of their axis's tick labels.
_AXIS_TITLES_OVER_TICKS = """root => {
  const boxesMeet = (a, b) => a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1;
  const found = [];
  for (const axis of root.querySelectorAll('.bqplot g.axis')) {
    const title = axis.querySelector('text.axislabel');
    if (!title || !title.textContent.trim()) continue;
    const t = title.getBoundingClientRect();
    if ([...axis.querySelectorAll('g.tick text')].some(tick => boxesMeet(t, tick.getBoundingClientRect())))
      found.push(title.textContent.slice(0, 40));
  }
  return found;
}"""

# Tables wider than the widget with no scrolling box around them: their right side is cut.
_CUT_TABLES = """root => {
  const edge = root.getBoundingClientRect().right + 1;
  const found = [];
  for (const table of root.querySelectorAll('table')) {
    if (table.offsetParent === null || table.getBoundingClientRect().right <= edge) continue;
    let scroller = table.parentElement;
    while (scroller && scroller !== root && !['auto', 'scroll'].includes(getComputedStyle(scroller).overflowX))
      scroller = scroller.parentElement;
    if (!scroller || scroller === root) found.push((table.innerText || '').trim().slice(0, 40));
  }
  return found;
}"""

# Neighbours in one box drawn over each other (a squeezed column of rows, say).
_OVERLAPS = """root => {
  const found = [];
  for (const box of root.querySelectorAll('.widget-vbox, .widget-hbox')) {
    const kids = [...box.children].filter(k => k.offsetParent !== null && k.getBoundingClientRect().height > 0);
    const column = getComputedStyle(box).flexDirection.startsWith('column');
    for (let i = 1; i < kids.length; i++) {
      const a = kids[i - 1].getBoundingClientRect(), b = kids[i].getBoundingClientRect();
      const into = column ? a.bottom - b.top : a.right - b.left;
      const side = column ? Math.min(a.right, b.right) - Math.max(a.left, b.left)
                          : Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
      if (into > 3 && side > 3) { found.push((kids[i].innerText || kids[i].className).trim().slice(0, 40)); break; }
    }
  }
  return found;
}"""

CHECKS = {
    "text clipped by its box": _CLIPPED,
    "axis title over tick labels": _AXIS_TITLES_OVER_TICKS,
    "table cut at the widget's edge": _CUT_TABLES,
    "widgets drawn over each other": _OVERLAPS,
}


def layout_problems(widget) -> dict[str, list[str]]:
    """Every check run on ``widget`` (a Playwright locator): {problem: [what shows it]}, empty when none."""
    found = {name: widget.evaluate(script) for name, script in CHECKS.items()}
    return {name: sorted(set(items)) for name, items in found.items() if items}
