"""Training recipes: the flag values tfbig-train takes for a model family, or one of its
presets, where the command line gives none. A flag on the command line always wins; the
values used are in MODEL_DIR/config.json like any other flag.

The `gpt/small` recipe is the main job's (`tfbig-train`, no flags: the small GPT on the
embedded plays in a 9-minute budget), tuned at the step count that budget gives on a 2-core
CPU (README, "the main job"). Other presets keep the TrainConfig defaults.

Example:
    recipe_for("gpt", "small")   # {"learning_rate": ..., "warmup_steps": ..., ...}
    apply(flags.FLAGS)           # in tfbig-train, before the config is read from the flags
"""

RECIPES = {
    "albert": {"optimizer": "lamb"},  # Lan et al. (2019)
    # The same tokens in more, smaller steps: batch 16 x 950 steps (what the 9-minute budget
    # gives it on a 2-core CPU: tokens/s are the same as at batch 32) 2.1468 bits per byte,
    # batch 8 x 1900 2.1378, batch 32 x 479 (lr 2e-3, warmup 30) 2.236; batch 32 x 424 with the
    # TrainConfig defaults (lr 1e-3, warmup 50) 2.2741. README, "the main job".
    "gpt/small": {"learning_rate": 2e-3, "warmup_steps": 60, "batch_size": 16},
}


def recipe_for(model, preset):
    """The recipe's {flag: value} for --model and --preset (the preset's entries win)."""
    return {**RECIPES.get(model, {}), **RECIPES.get(f"{model}/{preset}", {})}


def apply(flag_values):
    """Give the recipe's value to every flag of it the command line did not set; returns
    {flag: value} of those set."""
    chosen = {name: value for name, value in
              recipe_for(flag_values.model, flag_values.preset).items()
              if not flag_values[name].present}
    for name, value in chosen.items():
        setattr(flag_values, name, value)  # runs the flag's validators; `present` stays False
    return chosen


def describe():
    """Lines for --help: each recipe and its flags."""
    lines = ["Flags not given take the recipe of --model or --model/--preset first:"]
    for key, recipe in RECIPES.items():
        values = " ".join(f"--{name}={value:g}" if isinstance(value, float) else
                          f"--{name}={value}" for name, value in recipe.items())
        lines.append(f"  {key}: {values}")
    return "\n".join(lines)
