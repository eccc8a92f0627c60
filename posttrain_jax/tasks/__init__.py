"""Tasks and the task bank (level 1 of ARCHITECTURE.md).

    bank = TaskBank(TaskBankConfig(source="synthetic", generator="arithmetic",
                                   generator_config=ArithmeticConfig(max_digits=2),
                                   eval_fraction=0.05))
    it = bank.iterator()                       # checkpointable: it.get_state() / set_state()
    task = next(it)                            # Task(id, prompt="12+7=", answer="19", metadata)
    solution_text(task)                        # "19": the SFT target the grader accepts
    held_out = bank.eval_tasks()               # disjoint from the training stream

A task source (`TaskBankConfig.source`: jsonl, parquet, hf_disk, synthetic) and a synthetic
generator (`TaskBankConfig.generator`) are registries; every module of this package (and of
posttrain_jax/envs/, whose environments bring their task generators) is imported on the first
lookup, so a new source or task family is one file here plus its test.
"""
from posttrain_jax.tasks.bank import (SOURCES, SubsetSource, TaskBank, TaskBankConfig,
                                      TaskBankError, TaskIterator)
from posttrain_jax.tasks.files import HfDiskSource, JsonlSource, ParquetSource
from posttrain_jax.tasks.synthetic import (GENERATORS, ArithmeticConfig, CountdownConfig,
                                           GeneratorError, SyntheticSource, distinct_tasks,
                                           format_prompt, generate_task, register_generator,
                                           solution_text)
from posttrain_jax.tasks.task import Task, TaskError, is_held_out

__all__ = ["SOURCES", "GENERATORS", "ArithmeticConfig", "CountdownConfig", "GeneratorError",
           "HfDiskSource", "JsonlSource", "ParquetSource", "SubsetSource", "SyntheticSource",
           "Task", "TaskBank", "TaskBankConfig", "TaskBankError", "TaskError", "TaskIterator",
           "distinct_tasks", "format_prompt", "generate_task", "is_held_out",
           "register_generator", "solution_text"]
