# What torch's Inductor does about autotuning under torch.use_deterministic_algorithms(True):
# run on the H200 (torch 2.11) as a heredoc of the device call; prints the config flag and
# the lines of select_algorithm.py and config.py that mention determinism.
import inspect

import torch
import torch._inductor.config as config
import torch._inductor.select_algorithm as select_algorithm

torch.use_deterministic_algorithms(True)
print("config.deterministic under the flag:", config.deterministic)
for module in (select_algorithm, config):
    print(module.__name__, [line.strip() for line in inspect.getsource(module).splitlines()
                            if "determinis" in line][:14])
