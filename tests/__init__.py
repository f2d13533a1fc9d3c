"""kvscope's tests, one folder per wing (tests/core/ tests engine/core/, ...); the
end-to-end engine tests and the import rules stay here. A package so that test
folders named like the code (tests/monitor/, tests/logparse/) never shadow it."""
