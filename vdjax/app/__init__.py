"""Applications: the `vdjax` command line (`cli`, `commands`), the demo, the needle prompts and `vdjax
analyze`'s driver (`analyze`). Nothing in the library imports this package."""
