"""Task banks, graders and synthetic task generators (level 1 of ARCHITECTURE.md).

    bank = TaskBank(TaskBankConfig(source="synthetic", generator="arithmetic",
                                   generator_config=ArithmeticConfig(max_digits=2),
                                   eval_fraction=0.05))
    it = bank.iterator()                       # checkpointable: it.get_state() / set_state()
    task = next(it)                            # Task(id, prompt="12+7=", answer="19", metadata)
    grader = make_grader("numeric")            # (completion, task) -> GradeResult(reward, info)
    grader("19", task).reward                  # 1.0
    solution_text(task)                        # "19": the SFT target the grader accepts
    held_out = bank.eval_tasks()               # disjoint from the training stream
"""
from posttrain_jax.envs.graders import (
    GRADERS,
    CountdownGraderConfig,
    ExactMatchConfig,
    ExpressionError,
    GradeResult,
    Grader,
    GraderError,
    GraderSpec,
    NumericConfig,
    evaluate_expression,
    extract_expression,
    extract_final_answer,
    grade,
    last_boxed,
    make_grader,
    parse_number,
    register_grader,
)
from posttrain_jax.envs.synthetic import (
    GENERATORS,
    ArithmeticConfig,
    CountdownConfig,
    GeneratorError,
    SyntheticSource,
    distinct_tasks,
    format_prompt,
    generate_task,
    register_generator,
    solution_text,
)
from posttrain_jax.envs.task import Task, TaskError, is_held_out
from posttrain_jax.envs.task_bank import (
    SOURCES,
    HfDiskSource,
    JsonlSource,
    ParquetSource,
    SubsetSource,
    TaskBank,
    TaskBankConfig,
    TaskBankError,
    TaskIterator,
)
# the built-in environments register their task generators and envs
from posttrain_jax.envs import file_task, hidden_rule, tool_math  # noqa: E402,F401
