#!/usr/bin/env python3
"""Symbolize and summarize the stacks host_profile.so wrote (see host_profile.c).

    host_profile.py DIR UNSTRIPPED_EXE [--top N]

DIR holds maps.txt and one <label>.txt a window. The binary that ran may be a stripped copy of
UNSTRIPPED_EXE (strip moves no code), found in maps.txt as the mapping whose file name matches
neither a shared library nor anonymous memory. Frames in shared libraries are named by library
(libcuda, libc, ...), since their symbols stay on the GPU machine. For each window: samples a
thread, the functions where samples landed (self), the functions on the stack (inclusive: each
function counted once a sample), and self time by crate.
"""
import argparse
import collections
import os
import re
import subprocess


def mappings(path):
    maps = []
    for line in open(path):
        parts = line.split()
        if len(parts) < 6 or 'x' not in parts[1]:
            continue
        lo, hi = (int(v, 16) for v in parts[0].split('-'))
        maps.append((lo, hi, int(parts[2], 16), parts[5]))
    return maps


def load_segments(exe):
    """(p_offset, p_vaddr, p_filesz) of each PT_LOAD segment."""
    out = subprocess.run(['readelf', '-lW', exe], capture_output=True, text=True, check=True).stdout
    segs = []
    for line in out.splitlines():
        f = line.split()
        if f and f[0] == 'LOAD':
            segs.append((int(f[1], 16), int(f[2], 16), int(f[4], 16)))
    return segs


def is_main(name):
    return name.startswith('/') and '.so' not in os.path.basename(name)


def symbolize(exe, vaddrs):
    """Function name for each virtual address in the unstripped binary."""
    text = '\n'.join(hex(a) for a in vaddrs) + '\n'
    out = subprocess.run(['llvm-symbolizer', f'--obj={exe}', '--no-inlines', '--demangle', '--output-style=GNU'],
                         input=text, capture_output=True, text=True, check=True).stdout.splitlines()
    names = [out[i] for i in range(0, len(out), 2)][:len(vaddrs)]
    return [re.sub(r'::h[0-9a-f]{16}$', '', n) for n in names]


def crate(name):
    if name.startswith('['):
        return name.split('?')[0].rstrip(']') + ']'
    # llvm-symbolizer leaves Rust's legacy escapes in trait impls' names (`_$LT$a..b$u20$as$u20$..`).
    core = name.replace('_$LT$', '<').replace('$LT$', '<').replace('$u20$', ' ').replace('..', '::')
    core = re.sub(r'^<', '', core)
    core = re.sub(r'^(impl |dyn )', '', core)
    return core.split('::')[0].split('<')[0].split(' ')[0] or name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('dir')
    ap.add_argument('exe')
    ap.add_argument('--top', type=int, default=30)
    args = ap.parse_args()
    maps = mappings(os.path.join(args.dir, 'maps.txt'))
    segs = load_segments(args.exe)

    def place(addr):
        """('main', vaddr) or ('lib', label)."""
        for lo, hi, off, name in maps:
            if lo <= addr < hi:
                foff = addr - lo + off
                if is_main(name):
                    for p_off, p_vaddr, size in segs:
                        if p_off <= foff < p_off + size:
                            return ('main', foff - p_off + p_vaddr)
                    return ('lib', f'[{os.path.basename(name)}?+{foff:x}]')
                return ('lib', f'[{os.path.basename(name).split(".so")[0]}]')
        return ('lib', '[unmapped]')

    windows = sorted(f[:-4] for f in os.listdir(args.dir) if f.endswith('.txt') and f != 'maps.txt')
    cache = {}
    for label in windows:
        samples = []
        for line in open(os.path.join(args.dir, label + '.txt')):
            f = line.split()
            if len(f) < 2:
                continue
            # Frames 0–1 are the signal handler and the kernel's trampoline; each later address
            # is a return address (one byte back lands in the call).
            frames = [int(a, 16) for a in f[1:]]
            samples.append((int(f[0]), [frames[2]] + [a - 1 for a in frames[3:]]))
        todo = sorted({a for _, fr in samples for a in fr if a not in cache})
        placed = [place(a) for a in todo]
        mains = [(a, p[1]) for a, p in zip(todo, placed) if p[0] == 'main']
        for (a, _), name in zip(mains, symbolize(args.exe, [v for _, v in mains]) if mains else []):
            cache[a] = name
        for a, p in zip(todo, placed):
            if p[0] == 'lib':
                cache[a] = p[1]
        total = len(samples)
        print(f'=== {label}: {total} samples')
        threads = collections.Counter(t for t, _ in samples)
        print('threads:', ', '.join(f'{t}: {c}' for t, c in threads.most_common()))
        own = collections.Counter(cache[fr[0]] for _, fr in samples if fr)
        incl = collections.Counter()
        crates = collections.Counter(crate(cache[fr[0]]) for _, fr in samples if fr)
        for _, fr in samples:
            incl.update({cache[a] for a in fr})
        for title, counter in (('self', own), ('inclusive', incl), ('self by crate', crates)):
            print(f'--- {title}')
            for name, c in counter.most_common(args.top):
                print(f'{100 * c / total:6.1f}%  {name[:200]}')
        print()


if __name__ == '__main__':
    main()
