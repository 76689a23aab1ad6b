"""The two GLM-5.3-Flash text models parity compares: one forward, fed by a weight source and conventions.

serve = `GlmModel(config, HfWeights(hf_dir), Conventions.serve())`;
train = `GlmModel(config, w := MegatronWeights(mcore_dir), Conventions.train_default(layout=w.layout))`
(the mcore layout's defaults run the token-level DSA indexer: `indexer_kpool=off`).
"""
