from tfbig.convert import run

run()
