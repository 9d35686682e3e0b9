"""tfbig-train's recipes: the flags of a model or preset's recipe apply where the command line
gives none, never over a flag that was given, and only to their own model/preset."""
from absl import flags

from tfbig import config as config_lib
from tfbig.commands import recipes


def parsed(*args):
    flag_values = flags.FlagValues()
    config_lib.define_flags(flag_values)
    flag_values(["tfbig-train", *args])
    return flag_values


def test_the_small_gpt_takes_its_recipe_and_a_given_flag_wins():
    recipe = recipes.RECIPES["gpt/small"]
    flag_values = parsed("--learning_rate=5e-4")
    chosen = recipes.apply(flag_values)
    assert chosen == {k: v for k, v in recipe.items() if k != "learning_rate"}
    cfg = config_lib.from_flags(flag_values)
    assert cfg.train.learning_rate == 5e-4
    for name, value in chosen.items():
        assert getattr(cfg.train, name) == value != config_lib.TrainConfig().__getattribute__(name)


def test_the_small_llama_takes_the_main_jobs_width_and_schedule():
    flag_values = parsed("--model=llama")
    assert recipes.apply(flag_values) == recipes.RECIPES["gpt/small"]
    assert config_lib.from_flags(flag_values).train.hidden_size == 128


def test_other_presets_keep_the_defaults_and_albert_trains_with_lamb():
    flag_values = parsed("--preset=tiny")
    assert recipes.apply(flag_values) == {}
    assert config_lib.from_flags(flag_values).train == config_lib.TrainConfig(preset="tiny")
    flag_values = parsed("--model=albert", "--preset=small")
    assert recipes.apply(flag_values) == {"optimizer": "lamb"}  # not the small GPT's schedule
    assert parsed("--model=albert", "--optimizer=adamw").optimizer == "adamw"
    assert recipes.apply(parsed("--model=albert", "--optimizer=adamw")) == {}


def test_help_names_every_recipe():
    text = recipes.describe()
    assert "  albert: --optimizer=lamb\n" in text
    small = recipes.RECIPES["gpt/small"]
    line, = [line for line in text.splitlines() if line.startswith("  gpt/small: ")]
    assert f"--learning_rate={small['learning_rate']:g}" in line
