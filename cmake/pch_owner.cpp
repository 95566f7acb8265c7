// The translation unit that builds the precompiled header of the exe and test kinds
// (cmake/pch.cmake): it includes nothing of its own.
