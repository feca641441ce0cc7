"""Names and one-paragraph legends the CLI's ``--help`` shows (kept light: no heavy imports here).

The full glossary of every dashboard and tail field is docs/glossary.md."""

# the parts of a turn line, in order; --fields picks among them
TURN_FIELDS = (
    "ep",
    "t",
    "v",
    "in",
    "keep",
    "delta",
    "out",
    "finish",
    "reward",
    "tests",
    "drift",
    "routing",
    "timing",
    "action",
    "obs",
    "text",
)
LEGEND = """\
turn lines: ep=episode t=turn v=policy version that sampled it; in=input tokens, keep=leading tokens equal to
  the sequence so far, delta=new input tokens (in = keep + delta), out=output tokens; tests=verifier tests
  passed (– when the verifier did not run this turn); prev=sequence length after the episode's previous
  turn as this tail saw it (– when it did not see it): "clean" when keep = prev, DRIFT when keep < prev
  (retokenized: the learner repairs it), COMPACTED when the context policy rebuilt the input (a FORK by
  construction, counted), GAP when keep > prev (a turn this tail missed); routing start/rows:
  the R3 trace (on a clean boundary start = keep-1); sample/exec: seconds sampling (credit wait included)
  and running the action. Text is clipped (--max-text) and control characters are escaped (\\n, \\x1b)."""
