"""The hy3c compiler: trace → passes → package (see `hy3c.compiler.driver.compile_artifact`)."""
