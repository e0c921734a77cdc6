"""`hy3c.passes` (the top-level folder `passes/`, mapped into the `hy3c` namespace by setuptools'
package-dir so that it cannot collide with another distribution's `passes`): the compiler's graph
rewrites, one module and one class per pass (`base`: the interface, `registry`, `manager`: runs them
in recipe order and reports on each)."""
