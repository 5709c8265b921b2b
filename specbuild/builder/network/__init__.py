"""The torch network a build exports: the decoder, its layers, the step module, in-graph acceptance, the modes'
plugin base."""
