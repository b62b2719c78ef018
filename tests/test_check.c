// Tests of the test harness itself: check.h's check_report and e2e_lib.sh's e2e_end decide
// whether every other test passes, so each is run here on counts whose verdict is known. A
// test in which no check ran must fail like one in which a check failed: it proves nothing,
// and a test that silently stopped checking (a loop over an empty list, an early return)
// would otherwise pass for ever. Usage: test_check TESTS_DIR (the directory of e2e_lib.sh).
#include "check.h"

#include <sys/wait.h>
#include <unistd.h>

// check_report's verdict on the given counts, the real counts put back afterwards.
static int report_on(int passed, int failed, const char *name)
{
    int p = check_passed, f = check_failed;
    check_passed = passed;
    check_failed = failed;
    int rc = check_report(name);
    check_passed = p;
    check_failed = f;
    return rc;
}

static void test_report(void)
{
    CHECK_MSG(report_on(0, 0, "check_report, no check") != 0,
              "check_report passes a test in which no check ran");
    CHECK_MSG(report_on(1, 0, "check_report, 1 passed") == 0,
              "check_report fails a test whose only check passed");
    CHECK_MSG(report_on(5, 1, "check_report, 1 failed of 6") != 0,
              "check_report passes a test with a failed check");
    CHECK_MSG(report_on(0, 1, "check_report, 1 failed") != 0,
              "check_report passes a test whose only check failed");
}

// The exit status of `bash -c BODY` run after sourcing DIR/e2e_lib.sh, or -1 when bash could
// not be run.
static int e2e_status(const char *dir, const char *body)
{
    char script[512];
    snprintf(script, sizeof script, ". \"$1/e2e_lib.sh\"; %s", body);
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        execlp("bash", "bash", "-c", script, "e2e_lib", dir, (char *)NULL);
        _exit(127);
    }
    int st = 0;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st))
        return -1;
    return WEXITSTATUS(st) == 127 ? -1 : WEXITSTATUS(st);
}

static void test_e2e_end(const char *dir)
{
    int rc = e2e_status(dir, "e2e_start e2e_end_no_check; e2e_end");
    CHECK_MSG(rc > 0, "e2e_end with no check exited %d, wanted a failure", rc);
    rc = e2e_status(dir, "e2e_start e2e_end_one_ok; ok; e2e_end");
    CHECK_MSG(rc == 0, "e2e_end after one passed check exited %d, wanted 0", rc);
    rc = e2e_status(dir, "e2e_start e2e_end_one_bad; ok; bad 'one failed, as meant' 2>/dev/null; "
                         "e2e_end");
    CHECK_MSG(rc > 0, "e2e_end after a failed check exited %d, wanted a failure", rc);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_check TESTS_DIR\n");
        return 2;
    }
    test_report();
    test_e2e_end(argv[1]);
    return check_report("test_check");
}
