# The front door: wraps CMake so a newcomer needs two commands, `make demo` and `make test`.
# Both install what the build needs first (scripts/bootstrap.sh, a no-op when all is there).
#
#   make          build llmerge (build/), with the CUDA parts when the toolkit is found
#   make test     the CPU build's tests, then the sanitizer build's tests and the fuzzer
#   make demo     build, generate the fixtures and run llmerge on them
#   make bench    run the benchmarks and print their figures
#   make clean    remove the build trees
#   make install  copy build/llmerge to $(PREFIX)/bin and its man page to $(PREFIX)/share/man/man1
#                 (PREFIX=/usr/local; DESTDIR is put in front of both, for packaging); run `make`
#                 first: install builds nothing, so that `sudo make install` leaves no root-owned files

BUILD      ?= build
ASAN_BUILD ?= build-asan
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)
CUDA       ?= AUTO
FUZZ_SECONDS ?= 60
FUZZ_JSON_SECONDS ?= 30
FUZZ_YAML_SECONDS ?= 30
PREFIX     ?= /usr/local

.PHONY: all build bootstrap test test-cpu test-asan demo bench clean install

all: build

bootstrap:
	@bash scripts/bootstrap.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DLLMERGE_CUDA=$(CUDA)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

$(ASAN_BUILD)/CMakeCache.txt:
	CC=clang cmake -S . -B $(ASAN_BUILD) -DLLMERGE_CUDA=OFF -DLLMERGE_SANITIZE=ON \
	  -DLLMERGE_FUZZ=ON -DLLMERGE_FUZZ_SECONDS=$(FUZZ_SECONDS) -DLLMERGE_FUZZ_JSON_SECONDS=$(FUZZ_JSON_SECONDS) \
	  -DLLMERGE_FUZZ_YAML_SECONDS=$(FUZZ_YAML_SECONDS)

test:
	@bash scripts/bootstrap.sh --test
	@$(MAKE) --no-print-directory test-cpu
	@$(MAKE) --no-print-directory test-asan

test-cpu: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-asan: $(ASAN_BUILD)/CMakeCache.txt
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && ctest --output-on-failure -j $(JOBS)

demo: bootstrap
	@$(MAKE) --no-print-directory build
	@bash scripts/demo.sh $(BUILD)

bench: bootstrap
	@$(MAKE) --no-print-directory build
	@bash scripts/bench.sh $(BUILD)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)

install:
	@test -x $(BUILD)/llmerge || { echo "install: no $(BUILD)/llmerge: run make first" >&2; exit 1; }
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/man/man1
	install -m 755 $(BUILD)/llmerge $(DESTDIR)$(PREFIX)/bin/llmerge
	install -m 644 docs/llmerge.1 $(DESTDIR)$(PREFIX)/share/man/man1/llmerge.1
