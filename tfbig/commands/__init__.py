"""The console scripts, one module each: its flags, its `main` and `run()` (the entry point).

    train     tfbig-train          classify  tfbig-classify     squad    tfbig-squad
    generate  tfbig-generate       export    tfbig-export       convert  tfbig-convert
    plan      tfbig-plan           doctor    tfbig-doctor       profile  tfbig-profile
    consolidate  python -m tfbig.commands.consolidate MODEL_DIR OUT_DIR
    cli       what every command shares: --help, one-line user errors, exit codes
    recipes   tfbig-train's per-model defaults

A command wires flags to the library below it; no library module imports a command.
"""
