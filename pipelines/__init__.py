"""The trainer: the model's layers as DeepSpeed engines, and everything a training job needs around them.

`stages/` runs the layer list (pipeline stages, the pp = 1 module, the loss); `config/` reads a
run's layout and DeepSpeed settings; `memory/` plans and checks memory; `loop/` is the training
loop, its step and its faults; `job/` saves, resumes and initialises. `deepspeed_internals` is the
one module that touches DeepSpeed's private attributes.
"""
