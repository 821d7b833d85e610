"""`dflash export` (= `dflash-export`): trained drafters to the Hugging Face layouts (z-lab, speculators), a model card,
the Hub."""
