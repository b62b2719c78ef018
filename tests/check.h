// A minimal test harness shared by the test programs: CHECK-style assertions that record a
// failure and go on, and a closing line "N passed, N failed" that ctest's log shows. A test
// program returns check_report() from main: it fails when a check failed, and also when no
// check ran at all, since a test that checked nothing (an early return, a loop over nothing)
// proves nothing.
#ifndef LM_TEST_CHECK_H
#define LM_TEST_CHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int check_passed, check_failed;

#define CHECK(cond)                                                                           \
    do {                                                                                      \
        if (cond) {                                                                           \
            check_passed++;                                                                   \
        } else {                                                                              \
            check_failed++;                                                                   \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);          \
        }                                                                                     \
    } while (0)

#define CHECK_MSG(cond, ...)                                                                  \
    do {                                                                                      \
        if (cond) {                                                                           \
            check_passed++;                                                                   \
        } else {                                                                              \
            check_failed++;                                                                   \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);          \
            fprintf(stderr, __VA_ARGS__);                                                     \
            fputc('\n', stderr);                                                              \
        }                                                                                     \
    } while (0)

// An lm_status call that must succeed; prints the error message when it does not.
#define CHECK_OK(call, errp)                                                                  \
    do {                                                                                      \
        lm_status check_s_ = (call);                                                          \
        CHECK_MSG(check_s_ == LM_OK, "%s -> %s: %s", #call, lm_status_name(check_s_),         \
                  (errp)->msg);                                                               \
    } while (0)

// A call that must fail with `want` and a message containing `needle`.
#define CHECK_FAILS(call, want, needle, errp)                                                 \
    do {                                                                                      \
        lm_status check_s_ = (call);                                                          \
        CHECK_MSG(check_s_ == (want) && strstr((errp)->msg, (needle)) != NULL,                \
                  "%s -> %s \"%s\", wanted %s with \"%s\"", #call, lm_status_name(check_s_),   \
                  (errp)->msg, lm_status_name(want), (needle));                               \
    } while (0)

#define CHECK_NEAR(a, b, tol)                                                                 \
    do {                                                                                      \
        double check_a_ = (a), check_b_ = (b);                                                \
        CHECK_MSG(fabs(check_a_ - check_b_) <= (tol), "%s = %.9g, %s = %.9g", #a, check_a_,   \
                  #b, check_b_);                                                              \
    } while (0)

static inline int check_report(const char *name)
{
    printf("%s: %d passed, %d failed\n", name, check_passed, check_failed);
    if (check_passed + check_failed == 0) {
        fprintf(stderr, "%s: no check ran: a test that checks nothing fails\n", name);
        return 1;
    }
    return check_failed ? 1 : 0;
}

#endif
