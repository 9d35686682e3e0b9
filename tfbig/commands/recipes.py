"""Training recipes: the flag values tfbig-train takes for a model family, or one of its
presets, where the command line gives none. A flag on the command line always wins; the
values used are in MODEL_DIR/config.json like any other flag.

The `gpt/small` recipe is the main job's (`tfbig-train`, no flags: the small GPT on the
embedded plays in a 9-minute budget), width and schedule tuned at the step count that budget
gives on a 2-core CPU (docs/results.md, "The main job"). Other presets keep the TrainConfig defaults.

Example:
    recipe_for("gpt", "small")   # {"learning_rate": ..., "warmup_steps": ..., ...}
    apply(flags.FLAGS)           # in tfbig-train, before the config is read from the flags
"""

RECIPES = {
    "albert": {"optimizer": "lamb"},  # Lan et al. (2019)
    # The 9 minutes buy 2-5M tokens on a 2-core CPU, too few for the preset's hidden 256: at
    # hidden 128 a step costs 0.45x (10.0k against 4.5k tokens/s on a 2-core EPYC), and at the
    # steps the budget gives each there (batch 16), 1235 steps of hidden 128 reach 2.143 bits
    # per byte at lr 3e-3 and 2.156 at 2e-3, against 2.261 for 554 steps of hidden 256 at 2e-3
    # (6 layers of 128, 970 steps, 2e-3: 2.202). On a faster CPU's budget, hidden 256: batch
    # 16 x 950 steps 2.1468, batch 8 x 1900 2.1378, batch 32 x 479 2.236. docs/results.md, "The
    # main job".
    "gpt/small": {"hidden_size": 128, "learning_rate": 3e-3, "warmup_steps": 60,
                  "batch_size": 16},
    # The Llama family's main job (issue 41: at least the small GPT's bits per byte in the same
    # budget): the same width and schedule; its MLP is 8/3 x 128 rounded up to 512, three
    # matrices (196k weights a layer against the GPT's 131k), the embeddings tied.
    "llama/small": {"hidden_size": 128, "learning_rate": 3e-3, "warmup_steps": 60,
                    "batch_size": 16},
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
