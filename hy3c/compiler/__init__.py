"""`hy3c.compiler`: checkpoint + recipe → artifact — the trace of the step function (`trace`), the
driver running the recipe's passes (`hy3c.passes`) and packaging the weights (`driver`, `package`), and
what a user inspects afterwards (`inspect_artifact`, `why_not`)."""
