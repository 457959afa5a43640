/* The pod sandbox's process for gpu-agent's end-to-end cluster (no image registry is reachable
 * there, so the pause image is built from this file). It holds the pod's namespaces open: it
 * sleeps until SIGINT or SIGTERM, and reaps the children that are re-parented to it. Built
 * static by tests/e2e/images.py. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) {
    (void)sig;
    _exit(0);
}

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction act = {0};
    act.sa_handler = stop;
    if (sigaction(SIGINT, &act, NULL) < 0 || sigaction(SIGTERM, &act, NULL) < 0) return 1;
    act.sa_handler = reap;
    act.sa_flags = SA_NOCLDSTOP;
    if (sigaction(SIGCHLD, &act, NULL) < 0) return 2;
    for (;;) pause();
}
