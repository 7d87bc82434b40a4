// The emulation runners' job protocol (runner.cpp, tc_runner.cpp): arrays
// on stdin and stdout as a u64 byte count, then the bytes.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static std::vector<unsigned char> read_array() {
    uint64_t n = 0;
    if (std::fread(&n, 8, 1, stdin) != 1) std::exit(2);
    std::vector<unsigned char> v(n);
    if (n && std::fread(v.data(), 1, n, stdin) != n) std::exit(2);
    return v;
}

template <class T>
static std::vector<T> read_as() {
    auto b = read_array();
    std::vector<T> v(b.size() / sizeof(T));
    std::memcpy(v.data(), b.data(), v.size() * sizeof(T));
    return v;
}

template <class T>
static void write_array(const std::vector<T>& v) {
    uint64_t n = v.size() * sizeof(T);
    std::fwrite(&n, 8, 1, stdout);
    std::fwrite(v.data(), 1, n, stdout);
}
