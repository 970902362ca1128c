// MappedWord: the first 8 bytes of a file, read through a shared mapping
// without a system call, behind a SIGBUS guard (see mapped_word.cpp).
#pragma once

#include <Python.h>

namespace kvpages {

// Adds the MappedWord type to the module; returns -1 with an exception set on failure.
int AddMappedWord(PyObject* module);

}  // namespace kvpages
