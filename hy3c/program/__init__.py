"""`hy3c.program`: the artifact format, the contract between the compiler and the runtime — the
manifest model, file names, hashes and cache key (`manifest`), the program graph as JSON (`serialize`),
the ops a program may call (`allowlist`), the checks of every node (`check`) and the reading and
validation of an artifact directory (`artifact`). The compiler writes it, the runtime reads it; it
imports neither (nor any pass, trace code or Inductor)."""
