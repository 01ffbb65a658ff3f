"""Research tools over the engine: KV geometry (`geometry`), calibration prompts (`calibration`, `data`) and
the hybrid's mixes made from geometry or fitted (`hybrid`). Imports the engine, never
`vdjax.eval` or `vdjax.app`."""
